"""The serving loop behind ``flashgen demo``: a random-weight Llama-style decoder (model.py), continuous batching
over ``PagedKVCache`` (engine.py) with CUDA-graph decode (graphs.py), attention through the wrappers or the fp64
reference (backends.py) and the cascade-or-flat route of decode rows (route.py), the dense reference loop it is
checked against (dense.py), the studies of what paging is for (studies.py), the run's summary (report.py) and plot
(plot.py)."""

from .backends import ReferenceAttention, StepPlan, WrapperAttention, cascade_tables
from .dense import CheckResult, check_against_dense, dense_generate
from .engine import CHILD_STRIDE, Engine, EngineConfig, Request, StepRecord
from .model import ModelConfig, TinyLlama, dense_attention, sample
from .report import Summary, summarize
from .route import HostCosts, Route, route_decode

__all__ = ["CHILD_STRIDE", "CheckResult", "Engine", "EngineConfig", "HostCosts", "ModelConfig", "ReferenceAttention",
           "Request", "Route", "StepPlan", "StepRecord", "Summary", "TinyLlama", "WrapperAttention", "cascade_tables",
           "check_against_dense", "dense_attention", "dense_generate", "route_decode", "sample", "summarize"]
