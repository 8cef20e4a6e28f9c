"""KV copies between the host and a GPU, off the stream that computes.

A worker pulls the next batch's KV while the current batch computes, and serves its KV to peers
at any time. On a GPU a copy issued on the compute (default) stream waits behind every kernel
queued there, the running batch's included, and a copy from pageable host memory cannot overlap
anything. So these copies run on a stream of their own per thread, through pinned host memory:

* into a cache (``to_device``): ordered after the compute stream's last finished batch (a range
  the arena hands out may still be read by kernels in flight); the copies of one exchange end in
  an event (``copied``) that the cache keeps (``KVCache.ready``) and the compute stream waits
  for before a forward reads it (``CausalLM.forward``), or before its range is handed on;
* out of a cache (``to_host``): ordered after the compute stream's last batch (a token tree's
  accepted rows are moved into place at a batch's end); the host waits for that copy alone.

``batch_done`` marks a batch's end on the compute stream (the model runner calls it after each).
CPU tensors never come here (the transports copy them directly).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

_local = threading.local()  # this thread's copy stream per device
_done: dict[torch.device, torch.cuda.Event] = {}  # per device: the compute stream's last batch end


def _stream(device: torch.device) -> torch.cuda.Stream:
    streams = _local.__dict__.setdefault("streams", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def _after_compute(stream: torch.cuda.Stream, device: torch.device) -> None:
    done = _done.get(device)
    if done is not None:
        stream.wait_event(done)


def batch_done(device: torch.device) -> None:
    """A batch ended on ``device``'s current stream: copies from now on start after its kernels."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        _done[device] = event


def to_device(dest: torch.Tensor, rows: np.ndarray) -> None:
    """Copy host ``rows`` (``dest``'s bytes: bf16 as uint16) into the CUDA tensor ``dest`` on this
    thread's copy stream: enqueued, not waited for (``copied`` gives the event to wait on)."""
    staged = torch.from_numpy(rows).pin_memory()  # (the frame's bytes copied once, into pinned memory)
    stream = _stream(dest.device)
    _after_compute(stream, dest.device)
    with torch.cuda.stream(stream):
        dest.copy_(staged.view(dest.dtype), non_blocking=True)


def copied(device: torch.device) -> torch.cuda.Event:
    """An event after every copy this thread has enqueued for ``device`` so far."""
    event = torch.cuda.Event()
    event.record(_stream(device))
    return event


def to_host(src: torch.Tensor) -> torch.Tensor:
    """The CUDA tensor ``src`` copied into pinned host memory on this thread's copy stream, after
    the compute stream's last batch; the host waits for this copy alone, not the running batch."""
    stream = _stream(src.device)
    _after_compute(stream, src.device)
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(src, non_blocking=True)
    stream.synchronize()
    return host
