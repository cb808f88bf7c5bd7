"""The package's imports run one way: hook -> config -> features -> ops, with no circle.

Every module of ``deepspeed_fused`` is parsed (not imported) and each import statement in it
counts, at module level or inside a function (a deferred import that closes a circle is still a
circle: it only moves the failure to the first call). ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg``. Importing a submodule also runs
its parent packages' ``__init__``; those implicit edges are not counted (a package's
``__init__`` re-exporting its submodules is the package, not a circle), and
``deepspeed_fused/__init__.py`` (the public API, which installs the hook) sits at the top.
"""
import ast
import os
import pkgutil

import deepspeed_fused

PKG = "deepspeed_fused"
ROOT = os.path.dirname(deepspeed_fused.__file__)

# Layers from the bottom. A module may import modules of its own layer or of lower ones only.
# Everything not listed (the package itself, __main__, docs, bench, models, train) is a tool on
# top of the stack.
LAYERS = [("ops", f"{PKG}.ops"), ("features", f"{PKG}.features"), ("config", f"{PKG}.config"),
          ("hook", f"{PKG}.hook"), ("hook", f"{PKG}.report"), ("hook", f"{PKG}.compat")]
TOP = len(LAYERS)


def _layer(mod: str) -> tuple:
    order = []
    for name, prefix in LAYERS:
        if name not in order:
            order.append(name)
        if mod == prefix or mod.startswith(prefix + "."):
            return order.index(name), name
    return TOP, "tools"


def _modules() -> dict:
    """module name -> source path, for every module and package of deepspeed_fused."""
    out = {PKG: os.path.join(ROOT, "__init__.py")}
    for info in pkgutil.walk_packages([ROOT], prefix=PKG + "."):
        spec = info.module_finder.find_spec(info.name.rsplit(".", 1)[-1])
        out[info.name] = spec.origin
    return out


def _imports(mod: str, path: str, known: set) -> set:
    """The package modules ``mod`` imports anywhere in its source."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_pkg = os.path.basename(path) == "__init__.py"
    here = mod if is_pkg else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == PKG or a.name.startswith(PKG + "."):
                    found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == PKG or target.startswith(PKG + ".")):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if sub in known else target)
    found.discard(mod)
    return {m for m in found if m in known}


def _graph() -> dict:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package():
    g = _graph()
    for m in (f"{PKG}.hook", f"{PKG}.config", f"{PKG}.features.registry", f"{PKG}.features.moe_reorder",
              f"{PKG}.ops.rms_norm", f"{PKG}.ops.linear_cross_entropy.api", f"{PKG}.bench.e2e"):
        assert m in g
    assert f"{PKG}.features.registry" in g[f"{PKG}.config"]  # the section model is built from the registry
    assert f"{PKG}.ops._common" in g[f"{PKG}.features.base"]  # a deferred import is seen too


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_no_upward_import():
    bad = []
    for mod, deps in _graph().items():
        lv, lname = _layer(mod)
        for d in sorted(deps):
            dv, dname = _layer(d)
            if dv > lv:
                bad.append(f"{mod} ({lname}) imports {d} ({dname})")
    assert bad == []


def test_the_checks_catch_a_circle_and_an_upward_import():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _layer(f"{PKG}.ops.moe_reorder.api")[0] < _layer(f"{PKG}.features.moe_reorder")[0] \
        < _layer(f"{PKG}.config")[0] < _layer(f"{PKG}.hook")[0] < _layer(f"{PKG}.bench.e2e")[0]
