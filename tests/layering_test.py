#!/usr/bin/env python3
"""The layer rule, checked on the build's own compile commands.

usage: layering_test.py SOURCE_DIR BUILD_DIR   (BUILD_DIR has compile_commands.json)

Layers are folders are targets (docs/ARCHITECTURE.md). Each layer's target exports a
folder of its own (build/layers/<layer>/<layer> -> the source folder, CMake's
ferry_layer()), so a file sees the headers of exactly the layers its target links.
Three checks, each of which fails on a broken rule:

1. What a layer's target links stays inside RULE below: the layers its compile
   commands see (their -I folders) are a subset of the layers it may use. A new
   target_link_libraries that breaks the rule fails here. The consumers of the
   installed package (CONSUMERS) see include/ alone.
2. Every include of every file in a scanned folder (.cpp, .hpp, .cu, headers no
   compile command names included) names a layer that folder's compile commands
   see, and, where ONLY below narrows a layer to some of its headers, one of those.
   Both forms count, `"L/..."` and `<L/...>`, and a path with ./ or ../ is resolved
   against the including file's folder as the compiler resolves it, then judged by
   the layer it lands in. Scanned: the layers, include/ferry/ (the public headers:
   std, <dlpack/dlpack.h>, ferry/ and prometheus in metrics.hpp alone), CONSUMERS
   (ferry/ alone) and bench/, fuzz/ (what their targets see, where built).
3. The build refuses what the rule refuses: for one source of every layer, an
   include of another layer it may not use fails to preprocess with that source's
   own flags, while an include of one it may use succeeds. Without this half, 1 and
   2 could pass over a build that still exported the repository root.

Also, in every scanned folder: CAF's headers appear only in actors/*.cpp and
actors/*_internal.hpp, CUDA's only in gpu/cuda/. Each check of 2 and of these is
run on a bad probe too, and the test fails if the probe passes.
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
    "cache": {"cache", "common", "ferry"},
    "remote": {"remote", "cache", "common", "ferry"},
    "gpu": {"gpu", "common", "ferry"},
    "models": {"models", "io", "gpu", "common", "ferry"},
    # models/ through ONLY's headers alone (ferry_hf_config exports the folder).
    "synth": {"synth", "models", "io", "common", "ferry"},
    "actors": {"actors", "models", "io", "gpu", "common", "ferry"},
    "runtime": {"runtime", "actors", "models", "remote", "cache", "io", "gpu", "common", "ferry"},
    "tools": {"tools", "synth", "runtime", "actors", "models", "remote", "cache", "io", "gpu",
              "common", "ferry"},
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
# The public headers, as installed: they include each other, the standard library
# and DLPack; prometheus-cpp in metrics.hpp alone (ferry::metrics links it, ferry::ferry
# does not). Anything else would be a header the installed package does not ship.
PUBLIC = "include/ferry"
PUBLIC_THIRD_PARTY = {"dlpack/dlpack.h": None, "prometheus/": {"metrics.hpp"}}
STD_HEADER = re.compile(r"^[a-z_0-9]+$")   # <vector>, <cstdint>: no folder, no suffix
# Built on the installed package alone (libferry.so's API, ferry::ferry): the Python
# module, the stand-alone example and the package test's consumer. They may include
# ferry/ and third-party headers, never a layer.
CONSUMERS = ["python", "examples", "tests/package/consumer"]
# No rule of their own: they see what their targets link. Scanned where this build
# compiles them, so that a ../ include cannot reach past what the target sees.
TARGET_SEEN = ["bench", "fuzz"]
SUFFIXES = (".cpp", ".hpp", ".cu", ".cuh", ".h", ".in")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
CAF = re.compile(r"^caf/")
CUDA = re.compile(r"^(cuda|cub/|thrust/|cufile|nvml|nvtx)")


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


def unit_of(path):
    """The scanned folder (its rule's name) a repository path lies in: a layer, "ferry"
    for include/ferry/, a CONSUMERS or TARGET_SEEN folder, else its top folder."""
    if path.startswith(PUBLIC + "/"):
        return "ferry", path[len(PUBLIC) + 1:]
    for folder in sorted(CONSUMERS + TARGET_SEEN, key=len, reverse=True):
        if path.startswith(folder + "/"):
            return folder, path[len(folder) + 1:]
    top, _, rest = path.partition("/")
    return top, rest


def resolve(source_dir, rel, form, path):
    """Where `#include <path>` or `"path"` in the file `rel` lands, as the compiler
    looks: (unit, header) for a project header, None for a system or third-party one
    (or a generated one), or a string saying why it cannot be judged.

    A quoted include is looked for beside the including file first, so "x.hpp" and
    "../runtime/x.hpp" name the file that folder holds. Only when nothing is there
    does the compiler walk the -I folders; a path with ./ or ../ walked from those
    reaches other layers' folders (build/layers/io/../models/models/ is models/), so
    such an include that is not a file beside its includer is refused outright, and
    so is an angle-bracket one (never looked for beside the file)."""
    relative = any(p in (".", "..") for p in path.split("/"))
    if form == '"':
        local = os.path.normpath(os.path.join(os.path.dirname(rel), path))
        if not local.startswith("..") and os.path.isfile(os.path.join(source_dir, local)):
            return unit_of(local)
    if relative:
        return (f"{path} walks the include folders with ./ or ../ (not a file beside "
                "its includer), which reaches folders no rule can judge")
    top, _, rest = os.path.normpath(path).partition("/")
    if rest and top in LAYERS | {"ferry"}:
        return top, rest
    return None


def file_failures(source_dir, unit, rel, text, visible):
    """What is wrong with the includes of `text`, the file `rel` of the scanned folder
    `unit`, whose compile commands see `visible`. Returns (failures, project includes)."""
    failures = []
    checked = 0
    name = os.path.basename(rel)
    for m in INCLUDE.finditer(text):
        form, path = m.group(1), m.group(2).strip()
        line = text.count("\n", 0, m.start()) + 1
        where = f"{rel}:{line}: includes {form}{path}{'>' if form == '<' else form}"
        target = resolve(source_dir, rel, form, path)
        if isinstance(target, str):
            failures.append(f"{where}; {target}")
            continue
        if CAF.match(path) and not (unit == "actors" and (
                name.endswith(".cpp") or name.endswith("_internal.hpp"))):
            failures.append(f"{where}: CAF outside actors/*.cpp and actors/*_internal.hpp")
        if CUDA.match(path) and not rel.startswith("gpu/cuda/"):
            failures.append(f"{where}: a CUDA header outside gpu/cuda/")
        if target is None:
            # The public headers name what they include: an installed consumer has
            # the standard library, DLPack and (ferry::metrics) prometheus, no more.
            if unit == "ferry" and not STD_HEADER.match(path) and not any(
                    path.startswith(p) and (who is None or name in who)
                    for p, who in PUBLIC_THIRD_PARTY.items()):
                failures.append(f"{where}; the public headers include only the standard "
                                f"library, ferry/ and {sorted(PUBLIC_THIRD_PARTY)} (where "
                                "allowed)")
            continue
        checked += 1
        layer, header = target
        if layer == unit:
            continue
        if layer not in visible:
            failures.append(f"{where}, in {layer}/, which {unit}/ may not use (it sees "
                            f"{sorted(visible)})")
        elif header not in ONLY.get(unit, {}).get(layer, {header}):
            failures.append(f"{where}; {unit}/ may use {layer}/ only through "
                            f"{sorted(ONLY[unit][layer])}")
    return failures, checked


def scan(source_dir, folder, unit, visible):
    """file_failures over every file of `folder` (a path under SOURCE_DIR)."""
    failures, checked = [], 0
    for root, _, files in os.walk(os.path.join(source_dir, folder)):
        for name in sorted(files):
            if not name.endswith(SUFFIXES):
                continue
            path = os.path.join(root, name)
            with open(path, errors="replace") as f:
                text = f.read()
            fails, n = file_failures(source_dir, unit, os.path.relpath(path, source_dir),
                                     text, visible)
            failures += fails
            checked += n
    return failures, checked


def self_checks(source_dir, visible):
    """Bad includes each check of 2 must refuse, and good ones it must accept: a check
    that cannot fail proves nothing. Returns the failures (a probe judged wrong)."""
    def header_of(layer, keep=lambda h: True):
        hs = sorted(h for h in os.listdir(os.path.join(source_dir, layer))
                    if h.endswith(".hpp") and keep(h))
        return hs[0] if hs else None

    probes = []   # (unit, file, include line, visible, should fail)
    # A layer including one it may not use and one it may: each form, and ../ beside
    # the file; ../ through the include folders is refused whatever it names.
    for layer in sorted(visible):
        others = sorted(LAYERS - {layer})
        bad = next((o for o in others if o not in visible[layer] and header_of(o)), None)
        good = next((o for o in others if o in visible[layer] and o not in ONLY.get(layer, {})
                     and header_of(o)), None)
        rel = f"{layer}/probe.cpp"
        if bad:
            h = header_of(bad)
            for inc in (f'"{bad}/{h}"', f"<{bad}/{h}>", f'"../{bad}/{h}"',
                        f'"../../{bad}/{bad}/{h}"', f"<../{bad}/{bad}/{h}>"):
                probes.append((layer, rel, inc, visible[layer], True))
        if good:
            h = header_of(good)
            for inc in (f'"{good}/{h}"', f"<{good}/{h}>", f'"../{good}/{h}"'):
                probes.append((layer, rel, inc, visible[layer], False))
    # ONLY's narrowing (which no build could refuse), in each form.
    for layer, narrowed in sorted(ONLY.items()):
        if layer not in visible:
            continue
        for other, allowed in sorted(narrowed.items()):
            h = header_of(other, lambda h: h not in allowed)
            ok = sorted(allowed)[0]
            for inc in (f'"{other}/{h}"', f"<{other}/{h}>", f'"../{other}/{h}"'):
                probes.append((layer, f"{layer}/probe.cpp", inc, visible[layer], True))
            for inc in (f'"{other}/{ok}"', f"<{other}/{ok}>", f'"../{other}/{ok}"'):
                probes.append((layer, f"{layer}/probe.cpp", inc, visible[layer], False))
    # The public headers: an internal header in each form, a third-party one, and
    # prometheus outside metrics.hpp; std, DLPack and ferry/ pass.
    pub = f"{PUBLIC}/probe.hpp"
    internal = f"runtime/{header_of('runtime')}"
    for inc, bad in (('"common/error.hpp"', True), ("<common/error.hpp>", True),
                     (f'"../../{internal}"', True), ("<nlohmann/json.hpp>", True),
                     ("<prometheus/registry.h>", True), ("<vector>", False),
                     ("<dlpack/dlpack.h>", False), ('"ferry/export.hpp"', False),
                     ("<ferry/export.hpp>", False), ('"export.hpp"', False)):
        probes.append(("ferry", pub, inc, {"ferry"}, bad))
    probes.append(("ferry", f"{PUBLIC}/metrics.hpp", "<prometheus/registry.h>", {"ferry"},
                   False))
    # A consumer of the installed package reaching for a layer.
    for inc, bad in (("<common/error.hpp>", True), (f'"../{internal}"', True),
                     ("<ferry/ferry.hpp>", False)):
        probes.append(("python", "python/probe.cpp", inc, {"ferry", "python"}, bad))
    # CAF and CUDA out of their folders.
    for unit, rel, inc, bad in (("runtime", "runtime/probe.cpp", "<caf/all.hpp>", True),
                                ("actors", "actors/probe.hpp", "<caf/all.hpp>", True),
                                ("actors", "actors/probe.cpp", "<caf/all.hpp>", False),
                                ("gpu", "gpu/probe.cpp", "<cuda_runtime.h>", True),
                                ("gpu", "gpu/cuda/probe.cpp", "<cuda_runtime.h>", False)):
        probes.append((unit, rel, inc, visible.get(unit, RULE[unit]), bad))

    failures = []
    for unit, rel, inc, vis, bad in probes:
        got, _ = file_failures(source_dir, unit, rel, f"#include {inc}\n", vis)
        if bool(got) != bad:
            failures.append(f"self-check: #include {inc} in {rel} is "
                            f"{'not caught' if bad else 'refused: ' + got[0]}")
    return failures, len(probes)


def main():
    source_dir, build_dir = (os.path.abspath(p) for p in sys.argv[1:3])
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    failures = []

    # The compile commands of each scanned folder.
    by_layer, by_folder = {}, {}
    for e in commands:
        rel = os.path.relpath(e["file"], source_dir)
        if not e["file"].endswith((".cpp", ".cu")):
            continue
        layer = rel.split(os.sep)[0]
        if layer in RULE:
            by_layer.setdefault(layer, []).append(e)
        unit, _ = unit_of(rel)
        if unit in CONSUMERS + TARGET_SEEN:
            by_folder.setdefault(unit, []).append(e)
    for layer in sorted(RULE):
        if layer not in by_layer:
            failures.append(f"{layer}/: no compile command in {build_dir} (is the layer built?)")

    # 1. Links within the rule.
    visible = {}
    for folder, entries in sorted(by_layer.items()) + sorted(by_folder.items()):
        seen = set()
        for e in entries:
            v = visible_layers(e["command"], source_dir)
            seen |= v
            if "<repository root>" in v:
                failures.append(f"{os.path.relpath(e['file'], source_dir)}: compiled with the "
                                "repository root as an include path (every layer visible)")
        seen.discard("<repository root>")
        allowed = RULE.get(folder, {"ferry"} if folder in CONSUMERS else seen)
        extra = seen - allowed
        if extra:
            failures.append(f"{folder}/: its target sees {sorted(extra)}, which the layer rule "
                            f"does not allow it (allowed: {sorted(allowed)})")
        visible[folder] = seen | {folder}

    # 2. Every include of every file in a scanned folder names a visible layer. The
    # consumers are scanned whether built here or not (the package test builds
    # tests/package/consumer apart); bench/ and fuzz/ only where built, since what
    # they may see is what their targets link.
    checked = 0
    scans = [(layer, layer, visible[layer]) for layer in sorted(by_layer)]
    scans.append((PUBLIC, "ferry", {"ferry"}))
    scans += [(c, c, visible.get(c, {"ferry", c})) for c in CONSUMERS]
    scans += [(t, t, visible[t]) for t in TARGET_SEEN if t in visible]
    for folder, unit, vis in scans:
        fails, n = scan(source_dir, folder, unit, vis)
        failures += fails
        checked += n
    if checked < 100:
        failures.append(f"only {checked} includes found: is SOURCE_DIR right?")
    # ... and each of its checks refuses a bad include (ONLY's, which no build could
    # refuse, among them).
    fails, self_probes = self_checks(source_dir, {k: visible[k] for k in by_layer})
    failures += fails

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
    # The consumers' flags: the public headers, and no layer.
    for folder in sorted(set(CONSUMERS) & set(by_folder)):
        entry = sorted(by_folder[folder], key=lambda e: e["file"])[0]
        src = os.path.relpath(entry["file"], source_dir)
        for inc, want in (("ferry/ferry.hpp", True), ("common/error.hpp", False)):
            ok, err = preprocess(entry, f'#include "{inc}"\n')
            probes += 1
            if ok != want:
                failures.append(f"{src}'s flags {'cannot' if want else 'can'} include {inc}: "
                                f"{err if want else 'a consumer of the package sees a layer'}")
    if failures:
        print("\n".join(failures))
        return 1
    print(f"layering: {len(by_layer)} layers and {len(scans) - len(by_layer)} other folders, "
          f"{checked} includes, {self_probes} self-checks, {probes} compile probes: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
