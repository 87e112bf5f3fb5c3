"""SmolLM2-135M's shapes, shared by the scripts beside this one (random weights there: the
speed does not depend on the values)."""
from attnprec.config import ModelConfig

CONFIG = ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, mlp_hidden=1536, rope_base=100000.0, tie_embeddings=True,
                     max_seq_len=8192)
