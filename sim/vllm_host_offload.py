"""A CPU tier for vLLM's CPU build (``kvroute fleet --backend vllm-cpu --cpu-blocks N``).

vLLM 0.32's CPU offloading refuses to start on its CPU build: its worker copies pages with CUDA
streams ("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs";
docs/results/cpu-tier.md has the three configurations tried). Everything else of it is
platform-independent: the scheduler-side manager that decides what is stored, looked up, loaded and
evicted, the KV events it publishes (``BlockStored`` / ``BlockRemoved`` with medium ``CPU``) and the
offload counters (``vllm:kv_offload_load_bytes_total`` ...). This module keeps all of that and
replaces only the worker: ``HostOffloadingSpec`` is vLLM's ``CPUOffloadingSpec`` whose worker copies
whole KV pages between the engine's KV tensors and a host tensor with torch, synchronously. vLLM
loads it as an out-of-tree spec (``spec_name`` / ``spec_module_path`` of the OffloadingConnector).

The tier's size is ``kvroute_cpu_blocks`` blocks exactly (vLLM's own ``cpu_bytes_to_use`` would
round to its alignment). On the CPU build the engine's "GPU" KV is host memory too, so a load costs
a memcpy, not a PCIe transfer; what it gives is vLLM's own tier logic and events behind the router.

Runs inside vLLM's virtualenv (imports vllm and torch; the engines find it on their PYTHONPATH, see
``sim.vllm_cpu``), never in the project's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

#: The extra-config key of the tier's size in blocks (one engine block per offloaded block).
CPU_BLOCKS_KEY = "kvroute_cpu_blocks"


class HostCopyWorker(OffloadingWorker):
    """Copies whole pages: ``submit_store`` engine blocks -> host slots, ``submit_load`` back."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_slots: int, region: Any = None) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(
                f"HostOffloadingSpec copies one engine block per offloaded block; the offloaded "
                f"block size makes {blocks_per_chunk} (leave the connector's block_size unset)"
            )
        if len(kv_caches.group_data_refs) != 1:
            groups = len(kv_caches.group_data_refs)
            raise ValueError(f"HostOffloadingSpec handles one KV cache group, this model has {groups}")
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            self._engine.append(t.tensor.view(torch.int8).view((-1, t.page_size_bytes)))
            if region is None:
                self._host.append(torch.zeros((num_slots, t.page_size_bytes), dtype=torch.int8))
            else:  # the tiering spec's shared region, where its secondary tiers read and write
                self._host.append(region.create_next_worker_view(t.page_size_bytes))
        self._region = region
        self._page_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        self._finished: list[TransferResult] = []

    def _copy(
        self, job_id: int, dst: list[torch.Tensor], dst_ids: Any, src: list[torch.Tensor], src_ids: Any
    ) -> bool:
        if len(dst_ids) != len(src_ids):
            raise ValueError(f"offload job {job_id}: {len(src_ids)} source blocks for {len(dst_ids)} slots")
        t0 = time.perf_counter()
        s = torch.from_numpy(src_ids.astype("int64"))
        d = torch.from_numpy(dst_ids.astype("int64"))
        for to, frm in zip(dst, src, strict=True):
            to.index_copy_(0, d, frm.index_select(0, s))
        self._finished.append(
            TransferResult(job_id, True, len(src_ids) * self._page_bytes, time.perf_counter() - t0)
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, self._host, dst_spec.block_ids, self._engine, src_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, self._engine, dst_spec.block_ids, self._host, src_spec.block_ids)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy finished when it was submitted

    def shutdown(self) -> None:
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class _SizedInBlocks:
    """Mixed in before vLLM's spec: the CPU tier sized in blocks (``kvroute_cpu_blocks``, exact,
    where vLLM's ``cpu_bytes_to_use`` rounds to its alignment), one engine block per offloaded one."""

    num_chunks: int
    blocks_per_chunk: int

    def __init__(self, config: Any) -> None:
        blocks = config.extra_config.get(CPU_BLOCKS_KEY)
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise ValueError(f"{CPU_BLOCKS_KEY} must be a whole number of blocks >= 1, got {blocks!r}")
        # vLLM's spec requires a byte size; the size in blocks replaces what it makes of it.
        config.extra_config.setdefault("cpu_bytes_to_use", 1)
        super().__init__(config)  # type: ignore[call-arg]
        if self.blocks_per_chunk != 1:
            raise ValueError(
                f"{type(self).__name__} copies one engine block per offloaded block,"
                f" not {self.blocks_per_chunk}"
            )
        self.num_chunks = blocks
        self._host_worker: HostCopyWorker | None = None


class HostOffloadingSpec(_SizedInBlocks, CPUOffloadingSpec):
    """vLLM's CPU offloading with ``HostCopyWorker`` and a size in blocks."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._host_worker


class HostTieringOffloadingSpec(_SizedInBlocks, TieringOffloadingSpec):
    """vLLM's tiering (a CPU tier and secondary tiers behind it, e.g. ``fs`` on a folder several
    engines share: a STORAGE pool) with ``HostCopyWorker`` on the tiers' shared memory region."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if self._host_worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._host_worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
            except BaseException:
                region.cleanup()
                raise
        return self._host_worker
