"""The storage handlers behind the compress, quantize, sparsify and offload options."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from xirang_ds.plugins.activations.codecs import Payload, encode_int8, encode_lossless, encode_sparse, park_raw
from xirang_ds.plugins.activations.offload import HostCopy, OffloadGroup, Offloader
from xirang_ds.plugins.activations.storage import PayloadStorage, checksum


class CodecHandler:
    """Encodes saved storages into device payloads (lossless, int8 or sparse).

    Where a provider lends memory (the comm_buffers arena between reductions), a storage no
    encoding shrinks is still moved there as it is (``raw``): its own allocation is freed.

    Args:
        kind: ``compress`` (lossless), ``quantize`` (int8 blocks) or ``sparsify`` (threshold).
        storage: where payloads are allocated (the lending seam).
        block_size: elements per scale for ``quantize``.
        threshold: fraction of the largest magnitude dropped by ``sparsify``.
        mark: gives decoded tensors the activations role (the tracker's ``mark``); the decoder's
            own temporaries stay temporaries.
    """

    def __init__(self, kind: str, storage: PayloadStorage, block_size: int = 64, threshold: float = 0.0,
                 mark: Optional[Callable[[torch.Tensor], None]] = None):
        if kind not in ("compress", "quantize", "sparsify"):
            raise ValueError(f"unknown codec kind {kind!r}")
        self.kind = kind
        self.storage = storage
        self.block_size = block_size
        self.threshold = threshold
        self.mark = mark
        self.stored_bytes = 0
        self.encoded_bytes = 0

    def begin_call(self) -> None:
        """No per-call state."""
        return None

    def store(self, flat: torch.Tensor, call: Any) -> Optional[Payload]:
        """Encode ``flat``; ``None`` when the encoding would not be smaller."""
        with torch.no_grad():
            if self.kind == "compress":
                payload = encode_lossless(flat, self.storage)
            elif self.kind == "quantize":
                payload = encode_int8(flat, self.storage, self.block_size)
            else:
                payload = encode_sparse(flat, self.storage, self.threshold)
            if payload is None:
                payload = park_raw(flat, self.storage)
        if payload is not None:
            self.stored_bytes += flat.numel() * flat.element_size()
            self.encoded_bytes += payload.nbytes
            if self.storage.verify and payload.lease.lent:
                payload.meta["checksum"] = checksum(payload.lease.buffer[:payload.nbytes])
        return payload

    def restore(self, payload: Payload, dtype: torch.dtype, numel: int, keep: bool) -> torch.Tensor:
        """Decode (counted as activations) and hand lent bytes back (with ``keep``, once decoded for the
        last time: a backward over a retained graph decodes it again)."""
        with torch.no_grad():
            expected = payload.meta.get("checksum")
            if expected is not None:
                payload.lease.host_ready()
            if expected is not None and checksum(payload.lease.buffer[:payload.nbytes]) != expected:
                raise RuntimeError(f"xirang activations: a {payload.kind} payload of {payload.nbytes} bytes in lent "
                                   "memory changed between store and decode (overwritten by its lender)")
            flat = payload.decode()
        if self.mark is not None:
            self.mark(flat)
        if not keep:
            payload.release()  # lent bytes go back to the lender as soon as they are decoded
        return flat


class OffloadHandler:
    """Sends saved storages to host memory through the `Offloader`."""

    def __init__(self, offloader: Offloader):
        self.offloader = offloader

    def begin_call(self) -> OffloadGroup:
        """The call's prefetch group."""
        return self.offloader.begin_group()

    def store(self, flat: torch.Tensor, call: Optional[OffloadGroup]) -> HostCopy:
        """Start the copy of the storage's bytes to host memory."""
        return self.offloader.to_host(flat.view(torch.uint8), call)

    def restore(self, copy: HostCopy, dtype: torch.dtype, numel: int, keep: bool) -> torch.Tensor:
        """The bytes back on the device (prefetched or fetched now), as ``dtype``; with ``keep`` the
        host copy stays for the next backward."""
        return self.offloader.fetch(copy, keep).view(dtype)


class ShardHandler:
    """Stores a saved storage that is identical on every rank of a group (the tensor-parallel group)
    as this rank's 1/world of its bytes; restoring all-gathers the bytes over the group.

    Megatron's ``distribute_saved_activations`` does this for the inputs of a recomputed layer; every
    rank of the group must restore the same storages in the same order (the ranks run the same plan
    and the same graph). A storage whose size does not divide by the group size is kept as it is.

    Args:
        group: the process group the storage is replicated over.
        scope: the tracker's activations-scope factory (the gathered bytes in backward).
    """

    def __init__(self, group: Any, scope: Callable[[], Any]):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.scope = scope
        self.sharded_bytes = 0
        """Bytes of the storages stored as shards so far (the full sizes)."""

    def begin_call(self) -> None:
        return None

    def store(self, flat: torch.Tensor, call: Any) -> Optional[list[torch.Tensor]]:
        """This rank's part of the storage's bytes, in a box that `restore` empties (the shard is
        freed once the whole is gathered, not when the last view is unpacked)."""
        raw = flat.view(torch.uint8)
        if raw.numel() % self.world:
            return None
        part = raw.numel() // self.world
        self.sharded_bytes += raw.numel()
        return [raw[self.rank * part:(self.rank + 1) * part].clone()]

    def restore(self, box: list[torch.Tensor], dtype: torch.dtype, numel: int, keep: bool) -> torch.Tensor:
        shard = box[0] if keep else box.pop()
        part = shard.numel()
        with self.scope():
            full = torch.empty(part * self.world, dtype=torch.uint8, device=shard.device)
        mine = full[self.rank * part:(self.rank + 1) * part]
        mine.copy_(shard)
        del shard  # gathered in place (this rank's part is already where it belongs)
        self.dist.all_gather_into_tensor(full, mine, group=self.group)
        return full.view(dtype)
