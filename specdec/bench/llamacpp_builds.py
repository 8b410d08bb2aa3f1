"""llama.cpp builds side by side: prompt processing (512 tokens) and decoding (128 one-token steps)
of the embedded Q4_1 GGUF through specdec's LlamaCppLM, each build in its own process, the builds
interleaved round by round (so drift hits all alike); medians over rounds of the best of 2 timed
repeats per process.

    python -m specdec.bench.llamacpp_builds [--threads 2,1] [--rounds 3] NAME=SITE_DIR ...
        # SITE_DIR: where `pip install --target SITE_DIR llama_cpp_python-*.whl` put a build;
        # "NAME=" (empty) is the build installed in this environment.

Build a variant with the set-up's flags definition, e.g.
    CMAKE_ARGS="$(SPECDEC_LLAMA_CPU=x86-64-v4 sh scripts/llama-cmake-args.sh)" pip wheel --no-deps \\
        --no-cache-dir --no-binary llama-cpp-python -w /tmp/v4 llama-cpp-python==0.3.36
    pip install --no-deps --target /tmp/v4/site /tmp/v4/*.whl
A build that crashes is reported with its exit status (the probe's job in real use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE = """
import json, sys, time
import torch
from specdec.backends.llamacpp.model import LlamaCppLM
from specdec.models import embedded_gguf_path
lm = LlamaCppLM(embedded_gguf_path(), threads=int(sys.argv[1]), context=1024)
prompt = torch.randint(0, lm.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
pp, tg = [], []
for rep in range(3):
    cache = lm.new_cache(1)
    t0 = time.perf_counter(); out = lm.prefill(cache, [prompt]); t_pp = time.perf_counter() - t0
    token = int(out.logits[0].argmax())
    t0 = time.perf_counter()
    for _ in range(128):
        token = int(lm.forward(cache, torch.tensor([[token]])).logits[0, -1].argmax())
    if rep:  # the first repeat warms up
        pp.append(512 / t_pp); tg.append(128 / (time.perf_counter() - t0))
    del cache
print(json.dumps({"pp512": max(pp), "tg128": max(tg)}))
"""


def one_run(site: str, threads: int) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", ONE, str(threads)], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("builds", nargs="+", metavar="NAME=SITE_DIR")
    p.add_argument("--threads", default="2,1")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    builds = dict(b.split("=", 1) for b in args.builds)
    threads = [int(t) for t in args.threads.split(",")]
    runs: dict = {(t, n): [] for t in threads for n in builds}
    for rnd in range(args.rounds):
        for t in threads:
            for name, site in builds.items():
                runs[(t, name)].append(r := one_run(site, t))
                print(f"round {rnd + 1}, {t} threads, {name}: {r}", file=sys.stderr, flush=True)
    print("| build | threads | pp512 tok/s | tg128 tok/s |")
    print("|---|---:|---:|---:|")
    for (t, name), rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {name} | {t} | {rs[0]['error']} | |")
            continue
        print(f"| {name} | {t} | {statistics.median(r['pp512'] for r in ok):.0f} "
              f"| {statistics.median(r['tg128'] for r in ok):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
