"""Shared setup of the benchmark scripts: the checkpoint they read, and how a child
process is timed."""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def bench_args(build="build/release", runs=5, model=True):
    """The options the benchmarks share: --build (the tree holding `ferry`), --model (a
    checkpoint instead of the synthesized one) where `model`, and --runs (default
    `runs`) unless None; the caller adds its own and parses."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=build)
    if model:
        ap.add_argument("--model")
    if runs is not None:
        ap.add_argument("--runs", type=int, default=runs)
    return ap


def medium_checkpoint(build, model=None):
    """Returns (folder, shard paths, total bytes) of the benchmark checkpoint:
    `model` when given, else a medium Llama synthesized once under BUILD/bench-cache."""
    ferry = os.path.join(build, "ferry")
    model = model or os.path.join(build, "bench-cache", "llama-medium-seed1")
    if not os.path.exists(os.path.join(model, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(model), exist_ok=True)
        subprocess.run([ferry, "synth", "--family", "llama", "--preset", "medium", "--out", model],
                       check=True)
    files = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))
    return model, files, sum(os.path.getsize(f) for f in files)


def run_status(cmd, capture=True, timeout=None):
    """Runs cmd; returns (seconds, max RSS bytes measured from outside, exit code,
    stdout, stderr). The exit code is negative for a signal; a run past `timeout`
    seconds is killed (exit code -9). Output goes to temporary files (a pipe nobody
    drains would stall the child)."""
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out_f if capture else subprocess.DEVNULL, stderr=err_f)
        while True:  # wait4 reaps the child with its resource usage
            pid, status, usage = os.wait4(p.pid, os.WNOHANG if timeout else 0)
            if pid != 0:
                break
            if time.perf_counter() - t > timeout:
                p.kill()
                timeout = None  # then wait for it
            else:
                time.sleep(0.002)
        seconds = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        out = out_f.read().decode(errors="replace")
        err = err_f.read().decode(errors="replace")
    return seconds, usage.ru_maxrss * 1024, p.returncode, out, err


def run_measured(cmd, capture=True):
    """Runs cmd; returns (seconds, max RSS bytes measured from outside, stdout).
    Exits the benchmark when cmd fails."""
    seconds, rss, code, out, err = run_status(cmd, capture)
    if code != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{err}")
    return seconds, rss, out


def cell(values, scale=1.0, fmt="{:.2f}"):
    """A table cell: the median of `values` times `scale`, then (min-max)."""
    v = [x * scale for x in values]
    return (fmt + " (" + fmt + "-" + fmt + ")").format(statistics.median(v), min(v), max(v))


def synth_once(ferry, out, *args):
    """`ferry synth --out OUT ARGS` unless OUT holds a checkpoint already; returns OUT."""
    if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        subprocess.run([ferry, "synth", "--out", out, "--no-fsync", *args], check=True)
    return out


def drop_cache(files):
    """Evicts `files` from the page cache (synced first, so that nothing dirty stays)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files):
    """Reads `files` whole, so that they are in the page cache."""
    for path in files:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
