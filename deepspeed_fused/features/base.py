"""What a feature is: a name, a config model, a support check, apply and revert.

A feature's options are a :class:`FeatureConfig` subclass (in the style of DeepSpeed's
``DeepSpeedConfigModel``: unknown keys forbidden, strict types); the config section
(``deepspeed_fused.config``) is built from the registered features' models. Features patch a model (``engine.module`` or a bare ``nn.Module``), can undo it and can say
whether it is in force on a model (``is_applied``). They call
the ops' public functions and know nothing of Triton internals; the hook knows only the
registry.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import dis
import functools
from typing import Any, ClassVar, Optional

import torch
import torch.utils.checkpoint
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import StrictBool

from ..ops._common import device_reason, fallback_reported
from ..ops._common import reference_calls  # noqa: F401  (importable from here: the features' counting)


class FeatureConfig(DeepSpeedConfigModel):
    """Options every feature has. Subclasses add their own fields."""

    enabled: StrictBool = False
    """Turn the feature on. Off by default: an absent section changes nothing."""


@dataclasses.dataclass
class Environment:
    """What the machine and libraries offer, read once per apply."""

    torch_version: str
    triton_version: Optional[str]
    deepspeed_version: Optional[str]
    transformers_version: Optional[str]
    cuda_available: bool
    gpu_name: Optional[str]
    autoep_available: bool
    interpreter: bool

    @property
    def kernels_available(self) -> bool:
        return self.triton_version is not None and (self.cuda_available or self.interpreter)

    @classmethod
    def detect(cls) -> "Environment":
        from ..ops._common import interpreter_active

        def version(mod: str) -> Optional[str]:
            try:
                m = __import__(mod)
                return getattr(m, "__version__", "unknown")
            except Exception:
                return None

        cuda = torch.cuda.is_available()
        autoep = False
        try:
            import deepspeed.module_inject.auto_ep_layer as _ep  # noqa: F401

            autoep = hasattr(_ep, "permute_by_local_expert")
        except Exception:
            autoep = False
        return cls(
            torch_version=torch.__version__,
            triton_version=version("triton"),
            deepspeed_version=version("deepspeed"),
            transformers_version=version("transformers"),
            cuda_available=cuda,
            gpu_name=torch.cuda.get_device_name(0) if cuda else None,
            autoep_available=autoep,
            interpreter=interpreter_active(),
        )


class CallCounts:
    """How often a feature's patched code ran since it was applied, by what ran: ``fused`` (our
    kernels), ``reference`` (the op's own torch reference: no GPU, or an input the kernels cannot
    take; the op says which per call, see ``deepspeed_fused.ops._common.note_reference``) and
    ``eager`` (the model's own code). The patched code adds to them with plain Python increments
    (no device work, no sync); a report reads them when it is printed, so
    ``print(engine.deepspeed_fused_report)`` shows the counts of the run so far."""

    KINDS = ("fused", "reference", "eager")

    def __init__(self):
        self.fused = 0
        self.reference = 0
        self.eager = 0

    def since_now(self) -> "CallCounts":
        """A live view of this counter that starts at zero now (for counters shared by a process)."""
        return _CallCountsSince(self)

    def as_dict(self) -> dict:
        return {k: int(getattr(self, k)) for k in self.KINDS}

    def __str__(self) -> str:
        return ", ".join(f"{getattr(self, k)} {k}" for k in self.KINDS)

    def __repr__(self) -> str:
        return f"<calls: {self}>"


def op_call_mark() -> Optional[int]:
    """Read before a patched call's ops run, for :func:`count_op_call` after them: the thread's
    count of op calls that ran their torch reference (None while torch.compile traces: a traced
    call counts as fused)."""
    return None if torch.compiler.is_compiling() else reference_calls()


def count_op_call(calls: Optional[CallCounts], mark: Optional[int]) -> None:
    """Add one call to ``calls``: ``reference`` when an op of this call ran its torch reference
    since ``mark`` (:func:`op_call_mark`), else ``fused`` (every op of it ran its kernels)."""
    if calls is not None:
        if mark is not None and reference_calls() != mark:
            calls.reference += 1
        else:
            calls.fused += 1


# How torch.utils.checkpoint's non-reentrant checkpoint ends a recomputation early: once the
# region's last saved tensor is recomputed, its pack raises this, and the rest of the region's
# forward is skipped. (An empty tuple, which no exception matches, where torch has none.)
RECOMPUTE_STOP = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())


@contextlib.contextmanager
def counted_if_recompute_stops(count):
    """Run a patched call's ops; when a non-reentrant checkpoint's recomputation stops inside them
    (the stop comes from the pack of the region's last saved tensor, so every op of the call that
    saves for the backward has run), ``count()`` counts the call before the stop goes on, as the
    call's own count after its ops would have. Other exceptions pass through uncounted."""
    try:
        yield
    except RECOMPUTE_STOP:
        count()
        raise


class SharedCallCounts(CallCounts):
    """A process-wide counter (for a feature that patches process-wide code): copies of a model or a
    report refer to the one counter."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class _CallCountsSince(CallCounts):
    """A live view of ``source`` less its counts at the view's creation."""

    def __init__(self, source: CallCounts):  # noqa: super().__init__ not wanted: the counts are properties
        self._source = source
        self._base = tuple(getattr(source, k) for k in self.KINDS)

    @property
    def fused(self) -> int:
        return self._source.fused - self._base[0]

    @property
    def reference(self) -> int:
        return self._source.reference - self._base[1]

    @property
    def eager(self) -> int:
        return self._source.eager - self._base[2]


@dataclasses.dataclass
class FeatureReport:
    """What one feature did to one model."""

    name: str
    enabled: bool
    applied: bool = False
    where: str = ""  # e.g. "12 x Qwen3RMSNorm, 2 x LlamaRMSNorm"
    reason: str = ""  # why not applied, or notes (fallbacks, skipped modules)
    details: dict = dataclasses.field(default_factory=dict)
    fallback: str = ""  # applied, but what runs instead of the kernels here, e.g. "torch reference: no GPU"
    # applied: live counts of the patched code's calls since it was applied (None: not counted)
    calls: Optional[CallCounts] = dataclasses.field(default=None, compare=False)

    def to_dict(self) -> dict:
        """The report as plain data; ``calls`` as the counts at this moment."""
        d = dataclasses.asdict(dataclasses.replace(self, calls=None))
        d["calls"] = None if self.calls is None else self.calls.as_dict()
        return d

    @property
    def status(self) -> str:
        if not self.enabled and not self.applied:
            return "off"
        if self.applied:
            return f"applied ({self.fallback})" if self.fallback else "applied"
        return "not applied"


class Feature:
    """Base class of a feature. Subclasses set ``name`` and ``config_model`` and override
    ``is_supported``, ``apply`` and ``revert``."""

    name: ClassVar[str] = ""
    config_model: ClassVar[type] = None  # a FeatureConfig subclass
    # True for a feature that patches the engine (its optimizer), not the model: ``patch_model``
    # without an engine reports it not applied, and suites that patch bare models leave it off
    needs_engine: ClassVar[bool] = False

    def is_supported(self, env: Environment) -> tuple[bool, str]:
        return True, ""

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        raise NotImplementedError

    def revert(self, model: torch.nn.Module) -> int:
        raise NotImplementedError

    def is_applied(self, model: torch.nn.Module) -> Optional[bool]:
        """Whether the feature runs on ``model`` now, read from the model's own state (a copy or a
        model loaded from a pickle included). None: the feature cannot tell, and the hook goes by
        its record of what it applied to this model object."""
        return None

    def fallback(self, env: Environment) -> str:
        """For an applied feature: what runs instead of its kernels on this machine ("" when the
        kernels run), shown in the report's status, e.g. "torch reference: no GPU"."""
        return ""

    def serves(self, model: torch.nn.Module, engine: Any) -> bool:
        """For a feature applied to ``model``: whether what it applied serves ``engine`` too (False
        makes the hook apply it again). A feature of the model serves any engine; one that patches
        the engine (``needs_engine``) serves the engine it was applied with, so that a model given to
        ``deepspeed.initialize`` again gets its new engine patched."""
        return True


def reference_fallback(op: str, env: Environment) -> str:
    """:meth:`Feature.fallback` of a feature that stays applied where its op cannot launch kernels
    (the op runs its torch reference there): the report row's text, or "" where the kernels run.
    The row says it, so the op does not warn about the same reason at its first call."""
    if env.triton_version is None:
        fallback_reported(op, "Triton is not installed")
        return "torch reference: no Triton"
    if env.kernels_available:
        return ""
    if not env.cuda_available:
        fallback_reported(op, device_reason("cpu"))
    return "torch reference: no GPU"


class OptIn:
    """A feature's per-instance opt-in marker value: one shared object per feature that copies
    (``copy.copy``, ``copy.deepcopy``, ``nn.DataParallel`` replicas) keep as is and that pickles
    as ``False``, so a model loaded from a pickle runs eager until it is patched again."""

    __slots__ = ("_feature",)

    def __init__(self, feature: str):
        self._feature = feature

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (bool, (False,))

    def __repr__(self):
        return f"<deepspeed_fused {self._feature} opt-in>"


class OptInMarker:
    """The per-instance opt-in of a feature that installs a dispatcher on a module class once (for
    the life of the process) and runs its fused path only for the instances carrying the marker
    (``rms_norm``, ``rope``): the marker attribute holding the feature's :class:`OptIn` value, and
    the attribute holding the :class:`CallCounts` of the apply that opted the module in. Both are
    instance attributes, so copies and ``nn.DataParallel`` replicas keep them and a pickle loads
    the marker as ``False``."""

    def __init__(self, feature: str, marker: str, calls: str):
        self.value = OptIn(feature)
        self.marker = marker
        self.calls = calls

    def holds(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` carries the marker (its class's dispatcher may still be gone)."""
        return module.__dict__.get(self.marker) is self.value

    def mark(self, module: torch.nn.Module) -> None:
        module.__dict__[self.marker] = self.value

    def clear(self, model: torch.nn.Module) -> int:
        """Opt every module of ``model`` out (they run their eager forward) and drop their counts.
        Returns how many were opted in."""
        n = 0
        for module in model.modules():
            module.__dict__.pop(self.calls, None)
            if module.__dict__.get(self.marker) is self.value:
                del module.__dict__[self.marker]
                n += 1
        return n

    def count_calls(self, model: torch.nn.Module, is_replaced) -> CallCounts:
        """One fresh :class:`CallCounts` for the modules of ``model`` that ``is_replaced``: their
        dispatchers add their calls to it from now on."""
        calls = CallCounts()
        for module in model.modules():
            if is_replaced(module):
                module.__dict__[self.calls] = calls
        return calls


@functools.lru_cache(maxsize=4096)
def global_names(code) -> tuple:
    """The module globals a function's code loads, in first-use order (``co_names`` also holds
    attribute names): what a recognised forward reads from its module."""
    return tuple(dict.fromkeys(ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"))


def count_text(counter) -> str:
    """``"2 x LlamaRMSNorm, 1 x Qwen3RMSNorm"`` of a class name -> count mapping (by name)."""
    return ", ".join(f"{n} x {c}" for c, n in sorted(counter.items()))


def coverage_rows(module_names, pick, recognise) -> list:
    """A feature's coverage table: for each modeling module name, (module, name, form description or
    None, reason) of every module global, by name, that ``pick(module, name, value)`` selects (it
    returns what ``recognise`` reads, or None to leave the global out); ``recognise`` gives a form with
    ``describe()`` or the reason, a str, it stays eager. A module that does not import gives one row."""
    import importlib

    rows = []
    for mod_name in module_names:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # a module that does not import here (optional dependency)
            rows.append((mod_name, "", None, f"does not import ({type(e).__name__})"))
            continue
        for name, v in sorted(vars(mod).items()):
            target = pick(mod, name, v)
            if target is None:
                continue
            form = recognise(target)
            rows.append((mod_name, name, None, form) if isinstance(form, str) else (mod_name, name, form.describe(), ""))
    return rows


class ReplacementFeature(Feature):
    """A feature that replaces module classes' forwards by dispatchers and opts instances in with
    an :class:`OptInMarker` (``opt_in``): ``revert`` opts the model's modules out, ``is_applied``
    asks ``is_replaced`` of each module, and :meth:`replacement_report` writes the report of an
    apply. Subclasses set ``opt_in``, ``is_replaced`` (a staticmethod) and ``none_found`` (the
    reason when nothing was replaced)."""

    opt_in: ClassVar[OptInMarker] = None
    none_found: ClassVar[str] = ""
    fused_what: ClassVar[str] = ""  # what needs the kernels, for is_supported's reason ("the fused RoPE")

    def is_supported(self, env: Environment) -> tuple[bool, str]:
        if not env.kernels_available:
            return False, f"{self.fused_what} needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)"
        return True, ""

    @staticmethod
    def is_replaced(module: torch.nn.Module) -> bool:
        raise NotImplementedError

    def replacement_report(self, model: torch.nn.Module, replaced, already, skipped: dict, notes=(),
                           **details) -> FeatureReport:
        """The report of an apply: ``replaced`` and ``already`` (class name -> count) in force,
        ``skipped`` (reason -> {class name: count}), then ``notes``; ``details`` after the counts.
        When anything is in force, its modules count their calls from now on (``calls``)."""
        total = collections.Counter(replaced) + already
        notes = [f"skipped {count_text(c)}: {reason}" for reason, c in skipped.items()] + list(notes)
        if already:
            notes.insert(0, f"already replaced: {count_text(already)}")
        rep = FeatureReport(name=self.name, enabled=True, applied=bool(total), where=count_text(total),
                            details=dict(replaced=dict(replaced), already=dict(already), skipped=skipped, **details))
        if total:  # fused and eager calls of this model's replaced modules, counted from now on
            rep.calls = self.opt_in.count_calls(model, self.is_replaced)
        rep.reason = "; ".join(notes) if total else "; ".join([self.none_found] + notes)
        return rep

    def revert(self, model: torch.nn.Module) -> int:
        return self.opt_in.clear(model)

    def is_applied(self, model: torch.nn.Module) -> bool:
        return any(self.is_replaced(m) for m in model.modules())
