"""The architecture and presets the TPU tests and fixtures share (scripts/
capture_tpu_fixtures.py captures these programs; tests/test_tpu_fixtures.py and
tests/test_tpu.py audit them)."""
from attnprec.config import ModelConfig
from attnprec.precision import Precision

# The tiny recall architecture (gin/models/recall_tiny.gin), as the audit's defaults.
CONFIG = ModelConfig(vocab_size=98, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=32, mlp_hidden=256, max_seq_len=512)
SAFE = Precision(dtype="bfloat16")
PRESETS = {
    "fp32_attention": SAFE,
    "bf16": Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=False),
    "fp32": Precision(dtype="float32"),
    "highest": Precision(dtype="float32", einsum_precision="highest",
                         matmul_precision="highest"),
    "blockwise": Precision(dtype="bfloat16", kernel="blockwise"),
    "pallas": Precision(dtype="bfloat16", kernel="pallas"),
}
