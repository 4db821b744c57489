"""One resident copy of the frozen base weights for the tenants of a named pool's host process.

LoRA runs of one base model hold the same frozen tensors (every non-LoRA parameter with ``requires_grad=False``,
and the buffers): a host with N tenants would hold N copies. ``FrozenShare.share`` rebinds each frozen tensor of a
newly attached tenant's modules to the bitwise-equal tensor of the same name that a tenant already attached holds
(same kind, shape, dtype, device and bytes, compared, never assumed), so the tenants' modules reference one tensor
object: one copy in memory, and values that cannot differ between tenants. A tensor that differs (another base, a
fine-tuned buffer) stays the tenant's own. The adapter (names with ``lora_``), the optimizer state and the RNG
streams are per tenant; nothing rebinds them.

Nothing may write into a shared tensor: a named pool refuses a full fine-tune and a full-state ``weights_scope``
(``config/pool.py``, ``check_named``), and ``FrozenShare.check`` runs after every tenant call, raising when a
shared tensor's version counter moved (an in-place write: ``copy_``, ``load_state_dict``, an optimizer step).
A write through ``.data`` bypasses the counter; nothing in the library writes a frozen tensor that way. A tenant
that swaps a shared parameter's ``.data`` (``module.half()``) holds its own copy from then on, but its parameter keeps
the shared version counter: an in-place write into that copy would be reported as a write into the base (nothing
does that today).

The actors say what they hold through ``frozen_modules()`` (``pool/actors.py``): name -> ``nn.Module``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from unirl_core.errors import InvariantError, field_error

Key = tuple[str, str, str]
"""(module name, tensor name inside it, kind: ``param`` | ``buffer``)."""


@dataclass(frozen=True)
class ShareStats:
    """What one ``share`` call did: frozen tensors seen, how many now reference another tenant's, their bytes."""

    frozen: int
    shared: int
    shared_bytes: int


def frozen_slots(modules: Mapping[str, nn.Module]) -> Iterator[tuple[Key, nn.Module, str, torch.Tensor]]:
    """Every frozen tensor slot of ``modules``: (key, owning sub-module, attribute name, tensor). A tied tensor
    appears once per name that reaches it (each slot is rebound)."""
    for mod_name, module in modules.items():
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for kind, slots in (("param", sub._parameters), ("buffer", sub._buffers)):
                for leaf, t in slots.items():
                    name = f"{prefix}.{leaf}" if prefix else leaf
                    if t is None or "lora_" in name or t.requires_grad or not _plain(t):
                        continue
                    yield (mod_name, name, kind), sub, leaf, t


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor of this process (not a DTensor shard, meta or sparse tensor)."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have the same shape, dtype and device and equal bytes (NaNs compare by bits)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


class _Held:
    """The tensor objects of the tenants that reference one frozen tensor (aliases of one storage and version
    counter), held weakly: a dropped tenant's go, and the record lives while any tenant holds one."""

    __slots__ = ("key", "ptr", "refs", "version")

    def __init__(self, key: Key, t: torch.Tensor) -> None:
        self.key = key
        self.ptr = t.untyped_storage().data_ptr()  # the shared storage (alive while a holder references it)
        self.refs = [weakref.ref(t)]
        self.version: int | None = None  # the version counter when a second tenant was rebound to it

    def live(self) -> list[torch.Tensor]:
        """The holders' tensors still alive and still on the shared storage: a dropped tenant's are gone, and so is
        one whose tenant swapped its ``.data`` (``module.half()``: its own copy now, though it keeps the version
        counter). The references that left are dropped."""
        alive = [(r, t) for r in self.refs if (t := r()) is not None and t.untyped_storage().data_ptr() == self.ptr]
        self.refs = [r for r, _ in alive]
        return [t for _, t in alive]

    @property
    def name(self) -> str:
        return ".".join(self.key[:2])


class FrozenShare:
    """The frozen tensors of one host's tenants, by key; ``share`` rebinds a new tenant's to them."""

    def __init__(self) -> None:
        # key -> the tensor tenants reference (every tenant's alias of it); forgotten once no tenant holds one, so
        # a tensor no tenant holds is freed, and one stays shared after the tenant that brought it left
        self._held: dict[Key, _Held] = {}
        # id(record) -> (the written record, the call that wrote it): found by ``check``, named again by each later
        # check of a tenant that still holds the tensor, forgotten once no tenant does
        self._written: dict[int, tuple[_Held, str]] = {}

    def share(self, modules: Mapping[str, nn.Module]) -> ShareStats:
        """Rebind every frozen tensor of a new tenant's ``modules`` that has a bitwise-equal counterpart of the
        same key among the tenants already shared; register the others for later tenants."""
        frozen = shared = shared_bytes = 0
        with torch.no_grad():
            for key, sub, leaf, t in list(frozen_slots(modules)):
                frozen += 1
                record = self._held.get(key)
                live = record.live() if record is not None else []
                if not live:
                    self._held[key] = _Held(key, t)
                    continue
                held = live[0]
                if any(x is t for x in live) or not same_bits(held, t):
                    continue
                # an alias of ``held`` per tenant: the same storage and version counter (a write shows in ``check``),
                # its own tensor object, so a tenant's own .data swap (a dtype / device cast) or requires_grad
                # toggle stays its own
                if key[2] == "param":
                    alias = sub._parameters[leaf] = nn.Parameter(held.detach(), requires_grad=False)
                else:
                    alias = sub._buffers[leaf] = held.detach()
                record.refs.append(weakref.ref(alias))
                if record.version is None:
                    record.version = held._version
                shared += 1
                shared_bytes += t.numel() * t.element_size()
        return ShareStats(frozen=frozen, shared=shared, shared_bytes=shared_bytes)

    def check(self, where: str, holds: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Raise when a shared tensor was written in place since it was shared. A host runs one tenant call at a
        time and checks after each (a failed one too), so the call that just ran (``where``) is the one that wrote.
        The tensor stays written for every tenant holding it: a later check raises again, naming that first call,
        when ``holds(tensor)`` (the calling tenant references it; None: any tenant), until no tenant holds it."""
        fresh = []
        for key, record in list(self._held.items()):
            live = record.live()
            if not live:
                del self._held[key]
            elif (record.version is not None and live[0]._version != record.version
                  and id(record) not in self._written):
                self._written[id(record)] = (record, where)
                fresh.append(id(record))
        hit = []
        for ident, (record, writer) in list(self._written.items()):
            live = record.live()
            if not live:
                del self._written[ident]
            elif ident in fresh or holds is None or holds(live[0]):
                hit.append((record.name, writer))
        if hit:
            names = sorted(name for name, _ in hit)[:5]
            writers = sorted({writer for _, writer in hit})
            raise field_error(InvariantError, f"{'; '.join(writers)}: shared frozen tensors", names,
                              "no write into a base tensor the pool's other tenants also read",
                              "train LoRA adapters only (a full fine-tune or a full-state load keeps a pool of its "
                              "own: unset pool.name); the tenants holding it now read a changed base: end them and "
                              "start the runs again")

    def shared_count(self) -> int:
        """Frozen tensors a later tenant's slots were rebound to that a tenant still holds (shared when they were;
        the tenant that brought one may have left since)."""
        return sum(record.version is not None and bool(record.live()) for record in self._held.values())


def held_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the distinct storages the parameters and buffers of ``modules`` reference (a tensor shared by
    several modules counts once)."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if _plain(t):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; elsewhere its high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_freed() -> None:
    """Hand the heap memory freed since (a new tenant's own copies of the tensors it now shares) back to the OS:
    glibc keeps freed blocks below its adaptive mmap threshold (tens of MB) in the process. No-op elsewhere."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)
