"""Cheap access to torch's CUDA state on the launch path."""

from __future__ import annotations

import torch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on ``device_index`` (capture-aware, as torch's own ops)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


_stream_data = getattr(torch._C, "_cuda_getCurrentStream", None)
_STREAMS: dict[tuple, torch.cuda.Stream] = {}  # (stream id, device index, device type) -> torch's Stream for it


def current_torch_stream(device: torch.device) -> torch.cuda.Stream:
    """torch's current stream on ``device`` as a ``torch.cuda.Stream`` (what ``Event.record`` takes), one
    object per stream, made once: ``torch.cuda.current_stream`` builds a new one each call (several µs)."""
    if _stream_data is None:
        return torch.cuda.current_stream(device)
    data = _stream_data(device.index)
    stream = _STREAMS.get(data)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[data] = torch.cuda.current_stream(device)
    return stream


def capturing() -> bool:
    """Whether torch's current stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
