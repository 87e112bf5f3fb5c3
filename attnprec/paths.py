"""Where the repository's own files are (for library code: the gin/ directory holds the
precision presets the study reads)."""
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_GIN_DIR = os.path.join(REPO_ROOT, "gin")
