"""`kustomize build` for the subset deploy/kubernetes uses: `resources` (files, or directories with their own
kustomization.yaml) and `patches` in JSON 6902 form (inline `patch:` or a `path:`) with a `target` of kind and name.

Anything else in a kustomization.yaml is refused by name, so a new feature there fails the tests until this file
learns it, instead of being silently skipped. Where `kubectl` is installed, tests/deploy/test_kubernetes.py checks
this renderer's output against `kubectl kustomize`.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

_KNOWN = {"apiVersion", "kind", "resources", "patches"}
_TARGET_KEYS = {"kind", "name"}


def build(directory: Path) -> list[dict]:
    """The objects `kustomize build directory` writes (in the order of the files, not kustomize's sorted order)."""
    directory = Path(directory)
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if k.get("kind") != "Kustomization" or k.get("apiVersion") != "kustomize.config.k8s.io/v1beta1":
        raise ValueError(f"{directory}/kustomization.yaml: not a kustomize.config.k8s.io/v1beta1 Kustomization")
    if unknown := set(k) - _KNOWN:
        raise ValueError(f"{directory}/kustomization.yaml: {sorted(unknown)}: not implemented by tests/deploy/"
                         "kustomize.py (it renders resources and JSON 6902 patches); teach it")
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    ids = [_id(o) for o in objects]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{directory}: an object is defined twice: {sorted(i for i in ids if ids.count(i) > 1)}")
    for patch in k.get("patches", []):
        if set(patch.get("target", {})) - _TARGET_KEYS or not patch.get("target"):
            raise ValueError(f"{directory}: patch target {patch.get('target')}: only kind and name are implemented")
        ops = yaml.safe_load(patch["patch"]) if "patch" in patch else yaml.safe_load((directory / patch["path"])
                                                                                     .read_text())
        if not isinstance(ops, list):
            raise ValueError(f"{directory}: {patch}: only JSON 6902 patches (a list of operations) are implemented")
        targets = [o for o in objects if all(_field(o, key) == value for key, value in patch["target"].items())]
        if not targets:
            raise ValueError(f"{directory}: patch target {patch['target']} matches no object")
        for obj in targets:
            apply_json_patch(obj, ops)
    return objects


def _id(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _field(obj: dict, key: str):
    return obj["kind"] if key == "kind" else obj["metadata"]["name"]


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r}: must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _index(container: list, part: str, path: str, append: bool = False) -> int:
    if append and part == "-":
        return len(container)
    if not part.isdigit() or int(part) > len(container) - (0 if append else 1):
        raise ValueError(f"{path}: index {part!r} out of range (a list of {len(container)})")
    return int(part)


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / remove / replace / test on doc, in place; ValueError naming the path where one cannot apply
    (as kustomize refuses the build)."""
    for op in ops:
        kind, path = op["op"], op["path"]
        *parents, last = _pointer(path)
        node = doc
        for part in parents:
            try:
                node = node[_index(node, part, path)] if isinstance(node, list) else node[part]
            except (KeyError, TypeError):
                raise ValueError(f"{kind} {path}: {part!r} does not exist") from None
        value = copy.deepcopy(op.get("value"))
        if kind == "add":
            if isinstance(node, list):
                node.insert(_index(node, last, path, append=True), value)
            else:
                node[last] = value
            continue
        exists = (isinstance(node, list) and last.isdigit() and int(last) < len(node)) or (
            isinstance(node, dict) and last in node)
        if not exists:
            raise ValueError(f"{kind} {path}: {last!r} does not exist")
        key = int(last) if isinstance(node, list) else last
        if kind == "remove":
            del node[key]
        elif kind == "replace":
            node[key] = value
        elif kind == "test":
            if node[key] != value:
                raise ValueError(f"test {path}: {node[key]!r} is not {value!r}")
        else:
            raise ValueError(f"{kind} {path}: operation not implemented")
