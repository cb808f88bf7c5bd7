"""The report of what each feature did to a model: attached to the engine and logged as a table."""
from __future__ import annotations

import dataclasses

from . import compat
from .features.base import Environment, FeatureReport


CALLS_NOTE = ("fused / reference / eager: the calls of each applied feature's patched code since it was applied, "
              "by what ran: our kernels, the op's torch reference (no GPU, or an input the kernels cannot take), "
              "or the model's own code; a run's counts are live in engine.deepspeed_fused_report")
COUNT_COLUMNS = ("fused", "reference", "eager")


@dataclasses.dataclass
class Report:
    env: Environment
    features: list  # list[FeatureReport]
    notes: list = dataclasses.field(default_factory=list)  # compatibility fixes in force (deepspeed_fused.compat)

    def __getitem__(self, name: str) -> FeatureReport:
        for f in self.features:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def applied(self) -> list:
        return [f.name for f in self.features if f.applied]

    def to_dict(self) -> dict:
        return dict(env=dataclasses.asdict(self.env), features=[f.to_dict() for f in self.features],
                    notes=list(self.notes))

    def table(self) -> str:
        """One row per feature; the counts are read now (the calls of the patched code since it was
        applied, by what ran: :data:`COUNT_COLUMNS`)."""
        rows = [("feature", "enabled", "status") + COUNT_COLUMNS + ("where / why",)]
        for f in self.features:
            detail = f.where if f.applied else f.reason
            if f.applied and f.reason:
                detail = f"{f.where} ({f.reason})"
            counted = f.applied and f.calls is not None
            counts = tuple(str(getattr(f.calls, c)) if counted else "-" for c in COUNT_COLUMNS)
            rows.append((f.name, "yes" if f.enabled else "no", f.status) + counts + (detail or "-",))
        n = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(n)]
        out = []
        for i, r in enumerate(rows):
            out.append("  ".join(c.ljust(w) for c, w in zip(r[:n], widths)) + "  " + r[n])
            if i == 0:
                out.append("  ".join("-" * w for w in widths) + "  " + "-" * 11)
        return "\n".join(out)

    def __str__(self) -> str:
        e = self.env
        head = (f"deepspeed_fused report (torch {e.torch_version}, triton {e.triton_version}, "
                f"deepspeed {e.deepspeed_version}, transformers {e.transformers_version}, "
                f"GPU {e.gpu_name or 'none'})")
        return head + "".join(f"\n{n}" for n in self.notes) + "\n" + self.table()


def environment_text(env: Environment) -> str:
    lines = [
        f"torch:         {env.torch_version}",
        f"triton:        {env.triton_version or 'not installed'}",
        f"deepspeed:     {env.deepspeed_version or 'not installed'}",
        f"transformers:  {env.transformers_version or 'not installed'}",
        f"GPU:           {env.gpu_name or 'none (CPU only)'}",
        f"AutoEP:        {'present' if env.autoep_available else 'absent'}",
        f"AutoEP compat: {compat.autoep_status()}",
        f"kernels:       {'available' if env.kernels_available else 'unavailable (torch references run)'}"
        + (" [Triton interpreter]" if env.interpreter else ""),
    ]
    return "\n".join(lines)
