"""The package's shape: every op is a package with the parts kernels, launch, reference, checks and
api; every feature a package with patch, recognition and templates (its Feature class in
``__init__``); no source file is longer than the size rule allows.

A part is a module (``NAME.py``) or a subpackage (``NAME/``) that defines something of its own (a
function, a class or an assigned name, at module level or under a module-level ``if``/``try``): a
module that only imports names from elsewhere does not count. The checks read the source tree
(nothing is imported), and the last test runs them on a made-up tree to show that they fail where
a part is missing or empty.
"""
import ast
import os

import deepspeed_fused

ROOT = os.path.dirname(deepspeed_fused.__file__)
OP_PARTS = ("kernels", "launch", "reference", "checks", "api")
FEATURE_PARTS = ("patch", "recognition", "templates")
MAX_LINES = 850


def _defines_something(path: str) -> bool:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            return True
        if isinstance(node, ast.If):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.With):
            body += node.body
    return False


def _part_problem(pkg_dir: str, part: str) -> str:
    """'' when ``pkg_dir`` has the part ``part`` with content of its own, else what is wrong."""
    module, sub = os.path.join(pkg_dir, part + ".py"), os.path.join(pkg_dir, part)
    if os.path.isfile(module):
        files = [module]
    elif os.path.isfile(os.path.join(sub, "__init__.py")):
        files = [os.path.join(d, f) for d, _, fs in os.walk(sub) for f in fs if f.endswith(".py")]
    else:
        return f"{os.path.basename(pkg_dir)}: no {part} module or package"
    if not any(_defines_something(f) for f in files):
        return f"{os.path.basename(pkg_dir)}: {part} defines nothing of its own"
    return ""


def _packages(layer_dir: str) -> list:
    return sorted(os.path.join(layer_dir, n) for n in os.listdir(layer_dir)
                  if os.path.isfile(os.path.join(layer_dir, n, "__init__.py")))


def layout_problems(root: str) -> list:
    """Every way the tree under ``root`` (a deepspeed_fused source tree) breaks the layout rule."""
    problems = []
    ops_dir, features_dir = os.path.join(root, "ops"), os.path.join(root, "features")
    for pkg in _packages(ops_dir):
        problems += [p for p in (_part_problem(pkg, part) for part in OP_PARTS) if p]
    for name in os.listdir(ops_dir):
        if name.endswith(".py") and name != "__init__.py" and not name.startswith("_"):
            problems.append(f"ops/{name}: an op outside a package")
    for pkg in _packages(features_dir):
        problems += [p for p in (_part_problem(pkg, part) for part in FEATURE_PARTS) if p]
    for name in os.listdir(features_dir):
        if name.endswith(".py") and name not in ("__init__.py", "base.py", "registry.py"):
            problems.append(f"features/{name}: a feature outside a package")
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_LINES:
                    problems.append(f"{os.path.relpath(path, root)}: {n} lines (more than {MAX_LINES})")
    return problems


def test_ops_and_features_have_their_parts_and_no_file_is_too_long():
    assert layout_problems(ROOT) == []


def test_the_walk_sees_every_op_and_feature():
    ops = {os.path.basename(p) for p in _packages(os.path.join(ROOT, "ops"))}
    features = {os.path.basename(p) for p in _packages(os.path.join(ROOT, "features"))}
    assert {"rms_norm", "linear_cross_entropy", "moe_reorder", "rope"} <= ops
    assert {"rms_norm", "linear_cross_entropy", "moe_reorder", "rope"} <= features


def test_the_check_fails_on_a_missing_or_empty_part_and_a_long_file(tmp_path):
    def write(rel, text):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("ops/__init__.py", "")
    write("features/__init__.py", "")
    for part in OP_PARTS:
        write(f"ops/good/{part}.py", f"def {part}_fn():\n    return 1\n")
    write("ops/good/__init__.py", "from .api import api_fn\n")
    for part in FEATURE_PARTS:
        write(f"features/good/{part}.py", "X = 1\n")
    write("features/good/__init__.py", "")
    assert layout_problems(str(tmp_path)) == []

    # an op without launch, one whose api only re-exports, a kernels subpackage with content
    for part in ("kernels", "reference", "checks", "api"):
        write(f"ops/bad/{part}.py", "Y = 2\n")
    write("ops/bad/api.py", "from .checks import Y\n")
    write("ops/bad/__init__.py", "")
    write("features/worse/__init__.py", "")
    write("features/worse/patch.py", "if True:\n    def f():\n        pass\n")
    write("features/worse/recognition.py", "Z = 3\n")
    write("ops/lonely.py", "def f():\n    pass\n")
    write("ops/good/launch.py", "A = 1\n" * (MAX_LINES + 1))
    problems = layout_problems(str(tmp_path))
    assert "bad: no launch module or package" in problems
    assert "bad: api defines nothing of its own" in problems
    assert "worse: no templates module or package" in problems
    assert "ops/lonely.py: an op outside a package" in problems
    assert any(p.startswith("ops/good/launch.py: ") for p in problems)
    assert len(problems) == 5, problems
