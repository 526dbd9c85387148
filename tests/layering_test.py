#!/usr/bin/env python3
"""The layer rule, checked on the build's own compile commands.

usage: layering_test.py SOURCE_DIR BUILD_DIR   (BUILD_DIR has compile_commands.json)

Layers are folders are targets (docs/ARCHITECTURE.md). Each layer's target exports a
folder of its own (build/layers/<layer>/<layer> -> the source folder, CMake's
ferry_layer()), so a file sees the headers of exactly the layers its target links.
Three checks, each of which fails on a broken rule:

1. What a layer's target links stays inside RULE below: the layers its compile
   commands see (their -I folders) are a subset of the layers it may use. A new
   target_link_libraries that breaks the rule fails here.
2. Every `#include "L/..."` in a layer's folder (.cpp, .hpp, .cu, headers no compile
   command names included) names a layer that folder's compile commands see, and,
   where ONLY below narrows a layer to some of its headers, one of those.
3. The build refuses what the rule refuses: for one source of every layer, an
   include of another layer it may not use fails to preprocess with that source's
   own flags, while an include of one it may use succeeds. Without this half, 1 and
   2 could pass over a build that still exported the repository root.

Also: CAF's headers appear only in actors/*.cpp and actors/*_internal.hpp.
"""
import json
import os
import re
import shlex
import subprocess
import sys

# Which layers each library folder may include ("ferry" is include/ferry/, the public
# API every layer sees). Tests, fuzz and bench see what their targets link.
RULE = {
    "common": {"common", "ferry"},
    "io": {"io", "common", "ferry"},
    "gpu": {"gpu", "common", "ferry"},
    "models": {"models", "io", "gpu", "common", "ferry"},
    # models/ through ONLY's headers alone (ferry_hf_config exports the folder).
    "synth": {"synth", "models", "io", "common", "ferry"},
    "actors": {"actors", "models", "io", "gpu", "common", "ferry"},
    "runtime": {"runtime", "actors", "models", "io", "gpu", "common", "ferry"},
    "tools": {"tools", "synth", "runtime", "actors", "models", "io", "gpu", "common", "ferry"},
}
# Layers a folder may use through the headers named here only. synth/ is the loader's
# independent oracle: it reads config.json fields with models/hf_config.hpp and must
# never see the models' descriptors, or the loader would be tested against itself.
# The build cannot refuse those (the target that exports hf_config.hpp exports its
# folder), so check 2 does, and proves it would.
ONLY = {
    "synth": {"models": {"hf_config.hpp"}},
}
LAYERS = set(RULE) - {"ferry"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_0-9]+)/([^"]*)"', re.M)
CAF = re.compile(r'^\s*#\s*include\s+<caf/', re.M)


def visible_layers(command, source_dir):
    """The layer folders a compile command's -I flags make visible."""
    seen = set()
    args = shlex.split(command)
    for i, a in enumerate(args):
        path = None
        if a == "-I" or a == "-isystem":
            path = args[i + 1] if i + 1 < len(args) else None
        elif a.startswith("-I"):
            path = a[2:]
        if not path:
            continue
        path = os.path.normpath(path)
        if path == os.path.normpath(source_dir):
            seen.add("<repository root>")
        elif path == os.path.normpath(os.path.join(source_dir, "include")):
            seen.add("ferry")
        elif os.path.isdir(path):
            for name in os.listdir(path):
                if name in LAYERS and os.path.islink(os.path.join(path, name)):
                    seen.add(name)
    return seen


def preprocess(entry, text):
    """Preprocesses `text` with entry's flags; returns (ok, stderr)."""
    args = shlex.split(entry["command"])
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-MD", "-MMD") or a == entry["file"]:
            continue
        out.append(a)
    out += ["-E", "-x", "c++", "-o", os.devnull, "-"]
    r = subprocess.run(out, input=text, text=True, capture_output=True, cwd=entry["directory"],
                       timeout=120)
    return r.returncode == 0, r.stderr.strip().splitlines()[:1]


def include_failures(layer, rel, text, visible):
    """What is wrong with the `#include "L/..."` lines of `text`, a file of `layer`."""
    failures = []
    for m in INCLUDE.finditer(text):
        target, header = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        if target in LAYERS | {"ferry"} and target not in visible:
            failures.append(f"{rel}:{line}: includes {target}/, which {layer}/ may not "
                            f"use (it sees {sorted(visible)})")
        elif header not in ONLY.get(layer, {}).get(target, {header}):
            failures.append(f"{rel}:{line}: includes {target}/{header}; {layer}/ may use "
                            f"{target}/ only through {sorted(ONLY[layer][target])}")
    return failures


def main():
    source_dir, build_dir = (os.path.abspath(p) for p in sys.argv[1:3])
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    failures = []

    # The layers each library folder's compile commands see.
    by_layer = {}
    for e in commands:
        rel = os.path.relpath(e["file"], source_dir)
        layer = rel.split(os.sep)[0]
        if layer in RULE and e["file"].endswith((".cpp", ".cu")):
            by_layer.setdefault(layer, []).append(e)
    for layer in sorted(RULE):
        if layer not in by_layer:
            failures.append(f"{layer}/: no compile command in {build_dir} (is the layer built?)")

    # 1. Links within the rule.
    visible = {}
    for layer, entries in sorted(by_layer.items()):
        seen = set()
        for e in entries:
            v = visible_layers(e["command"], source_dir)
            seen |= v
            if "<repository root>" in v:
                failures.append(f"{os.path.relpath(e['file'], source_dir)}: compiled with the "
                                "repository root as an include path (every layer visible)")
        seen.discard("<repository root>")
        extra = seen - RULE[layer]
        if extra:
            failures.append(f"{layer}/: its target sees {sorted(extra)}, which the layer rule "
                            f"does not allow it (allowed: {sorted(RULE[layer])})")
        visible[layer] = seen | {layer}

    # 2. Every include of every file in a layer's folder names a visible layer.
    checked = 0
    for layer in sorted(visible):
        for root, _, files in os.walk(os.path.join(source_dir, layer)):
            for name in sorted(files):
                if not name.endswith((".cpp", ".hpp", ".cu", ".cuh", ".h", ".in")):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, source_dir)
                with open(path, errors="replace") as f:
                    text = f.read()
                checked += len(INCLUDE.findall(text))
                failures += include_failures(layer, rel, text, visible[layer])
                if CAF.search(text) and not (layer == "actors" and (
                        name.endswith(".cpp") or name.endswith("_internal.hpp"))):
                    failures.append(f"{rel}: includes CAF outside actors/*.cpp and "
                                    "actors/*_internal.hpp")
    if checked < 100:
        failures.append(f"only {checked} includes found: is SOURCE_DIR right?")
    # ... and it catches a header outside ONLY's (which no build could refuse).
    for layer, narrowed in sorted(ONLY.items()):
        for other in sorted(narrowed):
            outside = sorted(h for h in os.listdir(os.path.join(source_dir, other))
                             if h.endswith(".hpp") and h not in narrowed[other])
            probe = f'#include "{other}/{outside[0]}"\n'
            if layer in visible and not include_failures(layer, "probe", probe, visible[layer]):
                failures.append(f"an include of {other}/{outside[0]} in {layer}/ is not caught")

    # 3. The build refuses a forbidden include and accepts an allowed one.
    probes = 0
    for layer in sorted(by_layer):
        entry = sorted(by_layer[layer], key=lambda e: e["file"])[0]
        src = os.path.relpath(entry["file"], source_dir)
        for other in sorted(LAYERS - {layer}):
            headers = sorted(h for h in os.listdir(os.path.join(source_dir, other))
                             if h.endswith(".hpp") and
                             h in ONLY.get(layer, {}).get(other, {h}))
            if not headers:
                continue
            ok, err = preprocess(entry, f'#include "{other}/{headers[0]}"\n')
            probes += 1
            if other in RULE[layer] and not ok:
                failures.append(f"{src}'s flags cannot include {other}/{headers[0]}, which "
                                f"{layer}/ may use: {err}")
            if other not in RULE[layer] and ok:
                failures.append(f"{src}'s flags include {other}/{headers[0]}, which {layer}/ may "
                                "not use: the build does not enforce the layer rule")
    if failures:
        print("\n".join(failures))
        return 1
    print(f"layering: {len(by_layer)} layers, {checked} includes, {probes} compile probes: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
