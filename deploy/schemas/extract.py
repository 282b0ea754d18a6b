"""Extract a CRD version's openAPIV3Schema as a JSON Schema file.

    python deploy/schemas/extract.py CRD.yaml VERSION OUT.json [--prune a.b.c ...]

`description` keys are dropped (documentation only); every other keyword is kept as the CRD has it
(`x-kubernetes-*` keys too: jsonschema ignores them, and CEL rules are not evaluated). `--prune` removes
the named property subtrees (dotted paths through `properties` / `items`), to keep a vendored schema
small; with the test's strict mode a pruned field is then rejected, never silently accepted.
"""

from __future__ import annotations

import json
import sys

import yaml


def strip_descriptions(node):
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def prune(schema: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = schema
    for part in parents:
        node = node["items"] if part == "[]" else node["properties"][part]
    del node["properties"][leaf]


def main(argv: list[str]) -> int:
    crd_path, version, out_path, *rest = argv
    prunes = rest[1:] if rest[:1] == ["--prune"] else []
    with open(crd_path) as f:
        crd = yaml.safe_load(f)
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strip_descriptions(entry["schema"]["openAPIV3Schema"])
    for dotted in prunes:
        prune(schema, dotted)
    with open(out_path, "w") as f:
        json.dump(schema, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
