"""The serving loop behind ``flashgen demo --serve``: a random-weight Llama-style decoder (model.py),
continuous batching over ``PagedKVCache`` (engine.py), attention through the wrappers or the fp64 reference
(backends.py), the dense reference loop it is checked against (dense.py), and the run's summary (report.py)."""

from .backends import ReferenceAttention, StepPlan, WrapperAttention
from .dense import CheckResult, check_against_dense, dense_generate
from .engine import Engine, EngineConfig, Request, StepRecord
from .model import ModelConfig, TinyLlama, dense_attention, sample
from .report import Summary, summarize

__all__ = ["CheckResult", "Engine", "EngineConfig", "ModelConfig", "ReferenceAttention", "Request", "StepPlan",
           "StepRecord", "Summary", "TinyLlama", "WrapperAttention", "check_against_dense", "dense_attention",
           "dense_generate", "sample", "summarize"]
