"""pyramid-hf: Pyramid Speculative Decoding (draft -> qualifier -> target) for Hugging Face Transformers."""

from .acceptance import DIVERGENCES, RULES
from .assistant import PyramidAssistant
from .candidate_generator import PyramidCandidateGenerator
from .config import PyramidConfig
from .cpu_attention import use_packed_gqa
from .feature_draft import FeatureDraft
from .stats import PyramidStats

__version__ = "0.1.0"

__all__ = [
    "DIVERGENCES",
    "RULES",
    "FeatureDraft",
    "PyramidAssistant",
    "PyramidCandidateGenerator",
    "PyramidConfig",
    "PyramidStats",
    "__version__",
    "use_packed_gqa",
]
