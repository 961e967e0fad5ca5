"""Side by side with Mooncake's Transfer Engine and NIXL, their released wheels, in one run.

Run through scripts/peers-bench.sh (it builds the venv); this driver runs, for each round, every
engine of every scenario in turn (ours, Mooncake, NIXL, ours, ...), each in fresh processes,
collects one JSON line per row into OUT/rows.jsonl, and writes per scenario a text table
(OUT/<scenario>.txt) and an SVG plot (OUT/peers-<scenario>.svg); OUT/summary.jsonl holds one
line per compared row (medians over rounds, ratios).

Scenarios:
- ``p2p``: two processes on this host over TCP (ours: te tcp transport; Mooncake: protocol tcp;
  NIXL: UCX_TLS=tcp), write and read, block shapes and seed 000's KV shapes (p2p.py);
  ours from Python and from te-bench (Rust), Mooncake also through its C++
  transfer_engine_bench (block shapes only; it does not check bytes, so its rows say so).
- ``same-host``: each engine's best path between two processes of one host: NIXL with UCX's
  default transports (shared memory / CMA), ours with the shm transport from Python (the wheel
  carries it; TE_TRANSPORTS=shm,tcp, each row records the route the segment took) and from
  te-bench; Mooncake's non-CUDA wheel has no host shared-memory transport, so its best is its
  TCP row of ``p2p``.
- ``connector``: vLLM's Mooncake connector loop (two processes; ``initialize`` P2PHANDSHAKE tcp,
  ``register_memory``, one ``batch_transfer_sync_write`` per request of seed 000's KV fragments,
  61 layers x 32 pages) through ``te.compat.mooncake`` (engine ``compat``) and the real wheel.
- ``store``: UMBP local, standalone and distributed beside Mooncake Store, whole objects and
  seed 000's layer-wise restore (store.py).
- ``kill``: the target SIGKILLed during a 1 GiB write, then restarted at the same address and
  written to again (kill.py).
- ``register``: seed 001's 182 host buffers and 1,265 views of a 1 GiB pool (reg.py).
- ``first-contact``: the first transfer to a peer never contacted, cold and after each engine's
  warm-up call (p2p.py --first-contact).
A peer run that fails is reported with its error, never with a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PY = sys.executable
TE_BENCH = os.path.join(ROOT, "target/release/te-bench")
MC_BENCH = os.path.join(os.path.dirname(PY), "transfer_engine_bench")
KV = {"kv:1728": 1728, "kv:8448": 8448, "kv:37440": 37440}


def size(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def load() -> str:
    return open("/proc/loadavg").read().split()[:3].__str__()


class Runner:
    def __init__(self, out: str, verbose: bool):
        self.out = out
        self.rows = open(os.path.join(out, "rows.jsonl"), "a")
        self.log = open(os.path.join(out, "stderr.log"), "a")
        self.verbose = verbose

    def emit(self, row: dict):
        row.setdefault("load", load())
        self.rows.write(json.dumps(row) + "\n")
        self.rows.flush()
        if self.verbose:
            tag = row.get("error") or next((f"{k} {row[k]:.4g}" for k in ("gbps", "seconds", "seconds_to_return", "first_ms",
                                                                         "put_ms") if row.get(k) is not None), "done")
            print(f"  {row.get('scenario')} {row.get('engine')} {row.get('shape', '')} {row.get('op', '')}: {tag}",
                  file=sys.stderr, flush=True)

    def run(self, cmd, env=None, timeout=900):
        full_env = dict(os.environ)
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)  # the peer's default
            else:
                full_env[k] = v
        self.log.write(f"$ {' '.join(cmd)}  ({env or ''})\n")
        self.log.flush()
        try:
            p = subprocess.run(cmd, env=full_env, stdout=subprocess.PIPE, stderr=self.log, text=True, timeout=timeout)
            return p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            return None, e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")

    def json_rows(self, stdout):
        return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]

    # ---------------------------------------------------------------------------- scenarios

    def p2p_python(self, scenario, engine, shapes, ops, repeat, rnd, env, extra=()):
        cmd = [PY, os.path.join(HERE, "p2p.py"), "--engine", engine, "--shapes", ",".join(shapes),
               "--ops", ",".join(ops), "--repeat", str(repeat), "--round", str(rnd), *extra]
        rc, out = self.run(cmd, env)
        rows = self.json_rows(out)
        seen = {(r.get("shape"), r.get("op")) for r in rows}
        for r in rows:
            r["scenario"] = scenario
            self.emit(r)
        for s in shapes:
            for op in ops:
                if (s, op) not in seen:
                    self.emit({"bench": "peers-p2p", "scenario": scenario, "engine": engine, "api": "python",
                               "shape": s, "op": op, "round": rnd,
                               "error": f"no row: p2p.py exited with {rc} (see stderr.log)"})

    def p2p_te_bench(self, scenario, transport, shapes, ops, repeat, rnd, batch_bytes):
        engine = "ours-rust" if transport == "tcp" else f"ours-rust-{transport}"
        for s in shapes:
            for op in ops:
                if s in KV:
                    frag = KV[s]
                    args = ["--block-bytes", str(frag), "--total-bytes", str(frag * 256), "--scatter", "--batches", "8"]
                else:
                    b, t = s.split(":")
                    b, t = size(b), size(t)
                    per = min(t, max(b, batch_bytes // b * b))
                    args = ["--block-bytes", str(b), "--total-bytes", str(per), "--batches", str(t // per)]
                cmd = [TE_BENCH, "transfer", "--transport", transport, "--op", op, *args, "--repeat", str(repeat),
                       "--latency-samples", "20", "--verify", "--json"]
                rc, out = self.run(cmd)
                rows = self.json_rows(out)
                base = {"bench": "peers-p2p", "scenario": scenario, "engine": engine, "api": "rust",
                        "shape": s, "op": op, "round": rnd}
                if rc != 0 or not rows:
                    self.emit({**base, "error": f"te-bench exited with {rc}"})
                    continue
                r = rows[-1]
                if not r.get("verified") or r.get("mismatched_bytes"):
                    self.emit({**base, "error": f"{r.get('mismatched_bytes')} mismatched bytes"})
                    continue
                self.emit({**base, "gbps": r["gbps"], "gbps_runs": r["gbps_runs"], "block_bytes": r["block_bytes"],
                           "total_bytes": r["total_bytes"] * r["batches"], "batches": r["batches"],
                           "single_request_p50_us": r.get("p50_us"), "single_request_p99_us": r.get("p99_us"),
                           "mismatched_bytes": 0, "verified": True,
                           "note": "8 batches of one layer group's 256 fragments over one group-sized remote region"
                           if s in KV else "batches of --total-bytes over one batch-sized remote region"})

    def p2p_mooncake_bench(self, scenario, shapes, ops, rnd, duration, batch_bytes):
        """Mooncake's own C++ benchmark (block shapes only)."""
        for s in shapes:
            if s in KV:
                continue
            b = size(s.split(":")[0])
            batch = max(1, batch_bytes // b)
            buf = max(64 << 20, batch * b)
            for op in ops:
                base = {"bench": "peers-p2p", "scenario": scenario, "engine": "mooncake-cpp-bench", "api": "c++",
                        "shape": s, "op": op, "round": rnd, "verified": False,
                        "note": "transfer_engine_bench from the wheel, 1 thread, batch of 8 MiB; it does not check bytes"}
                tgt = subprocess.Popen([MC_BENCH, "--mode=target", "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                                        "--local_server_name=127.0.0.1:0", f"--buffer_size={buf}"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                port = None
                t_end = time.time() + 30
                while time.time() < t_end:
                    line = tgt.stderr.readline()
                    if not line:
                        break
                    m = re.search(r"listening on [0-9.]+:(\d+)", line)
                    if m:
                        port = m.group(1)
                    if "DRAM is used" in line or "numa node" in line:
                        break
                if port is None:
                    tgt.kill()
                    self.emit({**base, "error": "target printed no RPC port"})
                    continue
                cmd = [MC_BENCH, "--mode=initiator", "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                       "--local_server_name=127.0.0.1:0", f"--segment_id=127.0.0.1:{port}", f"--operation={op}",
                       f"--block_size={b}", f"--batch_size={batch}", "--threads=1", f"--duration={duration}",
                       f"--buffer_size={buf}"]
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
                tgt.kill()
                tgt.wait()
                m = re.search(r"throughput ([0-9.]+) GB/s", p.stdout)
                if p.returncode != 0 or not m:
                    tail = p.stdout.strip().splitlines()[-1:] or [""]
                    self.emit({**base, "error": f"exited with {p.returncode}: {tail[0][:200]}"})
                    continue
                self.emit({**base, "gbps": float(m.group(1)), "block_bytes": b})

    def register(self, scenario, engine, shape, rnd, scale, env=None):
        cmd = [PY, os.path.join(HERE, "reg.py"), "--engine", engine, "--shape", shape, "--round", str(rnd),
               "--scale", str(scale)]
        rc, out = self.run(cmd, env)
        rows = self.json_rows(out)
        if not rows:
            self.emit({"bench": "peers-register", "scenario": scenario, "engine": engine, "shape": shape,
                       "round": rnd, "error": f"reg.py exited with {rc}"})
        for r in rows:
            r["scenario"] = scenario
            self.emit(r)

    def first_contact(self, scenario, engine, mode, rnd, env=None):
        cmd = [PY, os.path.join(HERE, "p2p.py"), "--engine", engine, "--first-contact", mode, "--round", str(rnd)]
        rc, out = self.run(cmd, env)
        rows = self.json_rows(out)
        if not rows:
            self.emit({"bench": "peers-first-contact", "scenario": scenario, "engine": engine, "mode": mode,
                       "round": rnd, "error": f"p2p.py --first-contact exited with {rc}"})
        for r in rows:
            r["scenario"] = scenario
            self.emit(r)


    def store(self, scenario, engine, rnd, keys, pages, repeat):
        cmd = [PY, os.path.join(HERE, "store.py"), "--engine", engine, "--round", str(rnd), "--keys", str(keys),
               "--pages", str(pages), "--repeat", str(repeat)]
        rc, out = self.run(cmd, None, timeout=300)
        rows = self.json_rows(out)
        if not rows:
            for test in ("whole", "restore"):
                self.emit({"bench": "peers-store", "scenario": scenario, "engine": engine, "round": rnd, "test": test,
                           "error": f"store.py exited with {rc}"})
        for r in rows:
            r["scenario"] = scenario
            self.emit(r)

    def kill(self, scenario, engine, rnd, nbytes, after, restart_limit, env=None, extra=()):
        cmd = [PY, os.path.join(HERE, "kill.py"), "--engine", engine, "--round", str(rnd), "--bytes", nbytes,
               "--kill-after", str(after), "--restart-limit", str(restart_limit), *extra]
        rc, out = self.run(cmd, env, timeout=240)
        rows = self.json_rows(out)
        if not rows:
            # Tagged with its arm like kill.py's own rows, so the summary counts it in that row.
            arm = {"ours_transports": dict(zip(extra, extra[1:])).get("--ours-transports", "tcp")} if engine == "ours" \
                else {"ucx_tls": (env or {}).get("UCX_TLS") or "default"}
            self.emit({"bench": "peers-kill", "scenario": scenario, "engine": engine, "round": rnd, **arm,
                       "error": f"kill.py exited with {rc}"})
        for r in rows:
            r["scenario"] = scenario
            self.emit(r)


# -------------------------------------------------------------------------------- summarising


def med(xs):
    return statistics.median(xs) if xs else None


def summarise(out: str, versions: dict, command: str):
    rows = [json.loads(line) for line in open(os.path.join(out, "rows.jsonl"))]
    summary = []
    texts = {}
    svgs = {}
    for scenario in ("p2p", "same-host", "connector"):
        got = [r for r in rows if r.get("scenario") == scenario]
        if not got:
            continue
        engines = sorted({r["engine"] for r in got}, key=engine_order)
        keys = []
        for r in got:
            k = (r["shape"], r["op"])
            if k not in keys:
                keys.append(k)
        lines = [f"{scenario}: GB/s, median over rounds (rounds: {max(r['round'] for r in got) + 1}); "
                 "ratios below: ours (Python: ours; Rust: ours-rust) / peer"]
        head = f"{'shape':>10} {'op':>5} " + " ".join(f"{e:>13}" for e in engines)
        lines.append(head)
        plot = []
        for shape, op in keys:
            cells, meds = [], {}
            errs = {}
            for e in engines:
                rs = [r for r in got if r["engine"] == e and r["shape"] == shape and r["op"] == op]
                ok = [r["gbps"] for r in rs if "gbps" in r and "error" not in r]
                bad = [r["error"] for r in rs if "error" in r]
                if ok:
                    meds[e] = med(ok)
                    cells.append(f"{meds[e]:>13.3f}" + ("" if not bad else "*"))
                elif bad:
                    errs[e] = bad[0]
                    cells.append(f"{'failed':>13}")
                else:
                    cells.append(f"{'-':>13}")
            lines.append(f"{shape:>10} {op:>5} " + " ".join(cells))
            row = {"scenario": scenario, "shape": shape, "op": op, "gbps": meds, "errors": errs,
                   "rounds": {e: len([r for r in got if r['engine'] == e and r['shape'] == shape and r['op'] == op
                                      and 'gbps' in r]) for e in engines}}
            for field in ("batch_p50_us", "batch_p99_us", "cpu_s_per_gib_initiator", "cpu_s_per_gib_target"):
                row[field] = {e: med([r[field] for r in got if r["engine"] == e and r["shape"] == shape
                                      and r["op"] == op and field in r]) for e in engines}
                row[field] = {e: v for e, v in row[field].items() if v is not None}
            ratios = {}
            for ours in ("ours", "ours-rust", "ours-rust-shm", "compat"):
                if ours not in meds:
                    continue
                for e, v in meds.items():
                    if not e.startswith("ours") and e != "compat":
                        ratios[f"{ours}/{e}"] = meds[ours] / v
            row["ratios"] = ratios
            summary.append(row)
            plot.append(row)
        lines.append("")
        lines.append(f"{'shape':>10} {'op':>5} {'ratio':>24} {'value':>7}")
        for row in plot:
            for k, v in row["ratios"].items():
                lines.append(f"{row['shape']:>10} {row['op']:>5} {k:>24} {v:>7.2f}")
        lines.append("")
        lines.append("batch latency p50/p99 (us) and CPU s/GiB initiator/target (Python rows):")
        for row in plot:
            for e in engines:
                if e in row["batch_p50_us"]:
                    lines.append(f"{row['shape']:>10} {row['op']:>5} {e:>13} p50 {row['batch_p50_us'][e]:>10.0f} "
                                 f"p99 {row['batch_p99_us'][e]:>10.0f}  cpu {row['cpu_s_per_gib_initiator'][e]:>6.2f} "
                                 f"/ {row['cpu_s_per_gib_target'][e]:>6.2f}")
        for row in plot:
            for e, why in row["errors"].items():
                lines.append(f"FAILED {row['shape']} {row['op']} {e}: {why}")
        texts[scenario] = "\n".join(lines)
        svgs[scenario] = svg_bars(f"{scenario}: GB/s, median of rounds (log scale)", plot, engines)
    reg = [r for r in rows if r.get("scenario") == "register"]
    if reg:
        lines = ["register: wall seconds, median over rounds"]
        plot = []
        for shape in ("seed001", "views", "views-pool"):
            meds = {}
            errs = {}
            for e in ("ours", "mooncake", "nixl"):
                rs = [r for r in reg if r["engine"] == e and r["shape"] == shape]
                ok = [r["seconds"] for r in rs if "seconds" in r and "error" not in r]
                if ok:
                    meds[e] = med(ok)
                elif rs:
                    errs[e] = rs[0].get("error")
            if not meds and not errs:
                continue
            ratios = {f"{e}/ours": v / meds["ours"] for e, v in meds.items() if e != "ours" and "ours" in meds}
            row = {"scenario": "register", "shape": shape, "seconds": meds, "errors": errs, "ratios": ratios,
                   "rss_growth_mib": {e: med([r["rss_growth_mib"] for r in reg if r["engine"] == e
                                              and r["shape"] == shape and "rss_growth_mib" in r]) for e in meds}}
            summary.append(row)
            plot.append(row)
            lines.append(f"{shape:>10} " + "  ".join(f"{e} {v * 1e3:.3f} ms" for e, v in meds.items())
                         + "  " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
                         + "".join(f"  FAILED {e}: {w}" for e, w in errs.items()))
        texts["register"] = "\n".join(lines)
        svgs["register"] = svg_bars("register: milliseconds (log scale; lower is better)",
                                    [{"shape": r["shape"], "op": "", "gbps": {e: v * 1e3 for e, v in r["seconds"].items()}}
                                     for r in plot], ["ours", "mooncake", "nixl"], unit="ms")
    fc = [r for r in rows if r.get("scenario") == "first-contact"]
    if fc:
        lines = ["first-contact: milliseconds, median of every sample (connect: open the segment / add the peer; "
                 "first, second: the first two 4 KiB writes; warm: after the engine's warm-up call)"]
        for e in sorted({r["engine"] for r in fc}, key=engine_order):
            for mode in ("cold", "warm"):
                rs = [r for r in fc if r["engine"] == e and r.get("mode") == mode and "error" not in r]
                if not rs:
                    errs = [r["error"] for r in fc if r["engine"] == e and r.get("mode") == mode]
                    lines.append(f"{e:>10} {mode:>5} FAILED: {errs[0] if errs else 'no row'}")
                    continue
                fields = ["connect_ms", "warm_up_ms", "first_ms", "second_ms"]
                m = {f: med([r[f] for r in rs if r.get(f) is not None]) for f in fields}
                # Until the first byte landed, whatever the engine does lazily: the median of the sums.
                m["until_first_ms"] = med([sum(r.get(f) or 0.0 for f in fields[:3]) for r in rs])
                summary.append({"scenario": "first-contact", "engine": e, "mode": mode, **m, "samples": len(rs)})
                lines.append(f"{e:>10} {mode:>5} " + "  ".join(f"{f} {v:8.3f}" if v is not None else f"{f} {'-':>8}"
                                                                for f, v in m.items()))
        texts["first-contact"] = "\n".join(lines)
    kl = [r for r in rows if r.get("scenario") == "kill"]
    if kl:
        lines = ["kill: the target SIGKILLed during a write batch; milliseconds from the kill until the call returned"]
        for e in ("ours", "mooncake", "nixl"):
            if e == "ours":  # by the transports it was given, tcp first
                arms = sorted({r.get("ours_transports", "tcp") for r in kl if r["engine"] == e}, key=lambda t: t != "tcp")
                key = lambda r: r.get("ours_transports", "tcp")  # noqa: E731
            else:
                arms = sorted({r.get("ucx_tls", "default") for r in kl if r["engine"] == e}, key=lambda t: t != "tcp")
                key = lambda r: r.get("ucx_tls", "default")  # noqa: E731
            for tls in arms:
                rs = [r for r in kl if r["engine"] == e and key(r) == tls]
                if e == "ours":
                    routes = sorted({str(r.get("route")) for r in rs if r.get("route")})
                    label = f"ours (TE_TRANSPORTS={tls}; route {'/'.join(routes) or '?'})"
                else:
                    label = e if e != "nixl" else f"nixl (UCX_TLS={tls})"
                secs = [r["seconds_to_return"] for r in rs
                        if r.get("seconds_to_return") is not None and not r.get("returned_before_kill")]
                seen = [("finished before the kill" if r.get("returned_before_kill")
                         else str(r.get("outcome") or r.get("error"))) for r in rs]
                outcomes = [f"{o} ({seen.count(o)})" for o in sorted(set(seen))]
                dereg = [r["deregister_ms"] for r in rs if r.get("deregister_ms") is not None]
                msg = next((r.get("message") for r in rs if r.get("message")), None)
                call = [r["deregister_call_ms"] for r in rs if r.get("deregister_call_ms") is not None]
                ms = med([1e3 * x for x in secs])
                row = {"scenario": "kill", "engine": label, "ms_to_return": ms, "outcomes": outcomes,
                       "kill_after_s": med([r["kill_after_s"] for r in rs if r.get("kill_after_s") is not None]),
                       "deregister_ms": med(dereg), "deregister_call_ms": med(call), "runs": len(rs), "message": msg,
                       "deregister": sorted({str(r.get("deregister")) for r in rs}),
                       "next_transfer": sorted({str(r.get("next_transfer")) for r in rs if "next_transfer" in r}),
                       "next_ok": sum(1 for r in rs if str(r.get("next_transfer", "")).startswith("ok")),
                       "same_address": sum(1 for r in rs if r.get("same_address")),
                       "restart_s": med([r["restart_s"] for r in rs if r.get("restart_s") is not None]),
                       "next_ms": med([r["next_ms"] for r in rs if r.get("next_ms") is not None])}
                summary.append(row)
                lines.append(f"{label:>24} to error {fmt(ms, 1)} ms  outcomes {outcomes}  "
                             f"deregister {fmt(row['deregister_ms'])} ms (the call {fmt(row['deregister_call_ms'])} ms) "
                             f"{row['deregister']}  ({msg})")
        texts["kill"] = "\n".join(lines)
    st = [r for r in rows if r.get("scenario") == "store"]
    if st:
        lines = ["store: ms (median over rounds); whole: one batch put then one batch get; restore: seed 000's "
                 "layer-wise restore (put, TTFL in us, load)"]
        fields = {"whole": ("put_ms", "get_ms"), "restore": ("put_ms", "ttfl_us", "load_ms")}
        for test in ("whole", "restore"):
            tr = [r for r in st if r.get("test", "whole") == test]
            if not tr:
                continue
            meds, errs, info = {}, {}, {}
            for e in STORE_ENGINES:
                rs = [r for r in tr if r["engine"] == e and "error" not in r]
                if rs:
                    meds[e] = {k: med([r[k] for r in rs]) for k in fields[test]}
                    info = info or {k: rs[0].get(k) for k in ("keys", "object_bytes", "pages", "bytes", "fragments")}
                    lines.append(f"{test:>8} {e:>17} " + "  ".join(f"{k} {v:.3f}" for k, v in meds[e].items())
                                 + f"  ({len(rs)} rounds{', ' + rs[0]['ranged_api'] if 'ranged_api' in rs[0] else ''})")
                elif any(r["engine"] == e for r in tr):
                    errs[e] = next(r.get("error") for r in tr if r["engine"] == e)
                    lines.append(f"{test:>8} {e:>17} FAILED: {errs[e]}")
            row = {"scenario": "store", "test": test, "ms": meds, "errors": errs, **info}
            if "mooncake" in meds:
                # The peer's time over ours: >= 1.0 where we lead.
                row["ratios"] = {e: {k: meds["mooncake"][k] / v[k] for k in v if v[k]} for e, v in meds.items()
                                 if e.startswith("umbp")}
                for e, rt in row["ratios"].items():
                    lines.append(f"{test:>8} mooncake / {e}: " + "  ".join(f"{k} {v:.2f}x" for k, v in rt.items()))
            summary.append(row)
        texts["store"] = "\n".join(lines)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown(summary, versions, command))
    with open(os.path.join(out, "summary.jsonl"), "w") as f:
        f.write(json.dumps({"versions": versions, "command": command}) + "\n")
        for row in summary:
            f.write(json.dumps(row) + "\n")
    for name, text in texts.items():
        with open(os.path.join(out, f"{name}.txt"), "w") as f:
            f.write(f"versions: {versions}\ncommand: {command}\n{text}\n")
        print(f"\n== {name}\n{text}")
    for name, svg in svgs.items():
        with open(os.path.join(out, f"peers-{name}.svg"), "w") as f:
            f.write(svg)


def fmt(v, digits=3):
    return "—" if v is None else f"{v:.{digits}f}"


def bold(x):
    """A ratio (ours over the peer, >= 1.0 where we lead), bold where below 1.0x."""
    if x is None:
        return "—"
    return f"**{x:.2f}x**" if x < 1 else f"{x:.2f}x"


def markdown(summary, versions, command):
    """The side-by-side tables as docs/PERFORMANCE.md shows them."""
    out = [f"Peers: {', '.join(f'{k} {v}' for k, v in versions.items())}. Command: `{command}`.", ""]
    for scenario in ("p2p", "same-host", "connector"):
        rows = [r for r in summary if r.get("scenario") == scenario and "gbps" in r]
        if not rows:
            continue
        engines = sorted({e for r in rows for e in list(r["gbps"]) + list(r["errors"])}, key=engine_order)
        out.append(f"**{scenario}** (GB/s, median of rounds; ratio: ours over the best peer row)")
        out.append("")
        out.append("| shape | op | " + " | ".join(engines) + " | ours (Python) / best peer | ours (Rust) / best peer |")
        out.append("| --- | --- | " + " | ".join("---:" for _ in engines) + " | ---: | ---: |")
        for r in rows:
            peers = {e: v for e, v in r["gbps"].items() if not e.startswith("ours") and e != "compat"}
            best = max(peers.items(), key=lambda kv: kv[1]) if peers else None
            cells = []
            for e in engines:
                if e in r["gbps"]:
                    cells.append(fmt(r["gbps"][e]))
                elif e in r["errors"]:
                    cells.append("failed")
                else:
                    cells.append("—")
            rust = r["gbps"].get("ours-rust") or r["gbps"].get("ours-rust-shm")
            py = r["gbps"].get("ours") or r["gbps"].get("compat")
            def ratio(ours):
                if not (best and ours):
                    return "—"
                x = f"{ours / best[1]:.2f}x"
                return (f"**{x}**" if ours < best[1] else x) + f" ({best[0]})"

            ratio_py, ratio_rs = ratio(py), ratio(rust)
            out.append(f"| {r['shape']} | {r['op']} | " + " | ".join(cells) + f" | {ratio_py} | {ratio_rs} |")
        out.append("")
        py = [e for e in engines if r["batch_p50_us"] is not None and any(e in x["batch_p50_us"] for x in rows)]
        if py:
            out.append(f"{scenario}, Python rows: batch latency p50 / p99 in ms; CPU seconds per GiB moved, "
                       "initiator + target (each whole process: the engine's threads and the Python caller)")
            out.append("")
            out.append("| shape | op | " + " | ".join(f"{e} p50 / p99" for e in py) + " | "
                       + " | ".join(f"{e} CPU s/GiB" for e in py) + " |")
            out.append("| --- | --- | " + " | ".join("---:" for _ in py * 2) + " |")
            for r in rows:
                lat = [f"{r['batch_p50_us'][e] / 1e3:.2f} / {r['batch_p99_us'][e] / 1e3:.2f}"
                       if e in r["batch_p50_us"] else "—" for e in py]
                cpu = [f"{r['cpu_s_per_gib_initiator'][e]:.2f} + {r['cpu_s_per_gib_target'][e]:.2f}"
                       if e in r["cpu_s_per_gib_initiator"] else "—" for e in py]
                out.append(f"| {r['shape']} | {r['op']} | " + " | ".join(lat + cpu) + " |")
            out.append("")
    reg = [r for r in summary if r.get("scenario") == "register"]
    if reg:
        out.append("**register** (milliseconds, median of rounds; lower is better; ratio: the peer's time over ours)")
        out.append("")
        out.append("| shape | ours | Mooncake | NIXL | Mooncake / ours | NIXL / ours |")
        out.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in reg:
            s = r["seconds"]
            cell = lambda e: fmt(s[e] * 1e3) if e in s else ("failed" if e in r["errors"] else "—")  # noqa: E731
            rt = lambda e: bold(r["ratios"].get(e + "/ours"))  # noqa: E731
            out.append(f"| {r['shape']} | {cell('ours')} | {cell('mooncake')} | {cell('nixl')} | {rt('mooncake')} | {rt('nixl')} |")
        out.append("")
    fc = [r for r in summary if r.get("scenario") == "first-contact"]
    if fc:
        out.append("**first contact** (milliseconds, median of every sample: one fresh process each, --repeat per "
                   "round; one 4 KiB write; ratio: the peer's time until the first write returned over ours)")
        out.append("")
        out.append("| engine | mode | samples | connect | warm-up call | first write | until first write | "
                   "second write | peer / ours |")
        out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        ours = {r["mode"]: r["until_first_ms"] for r in fc if r["engine"] == "ours"}
        for r in fc:
            base = ours.get(r["mode"])
            ratio = bold(r["until_first_ms"] / base) if base and r["engine"] != "ours" else "—"
            out.append(f"| {r['engine']} | {r['mode']} | {r['samples']} | {fmt(r['connect_ms'])} | "
                       f"{fmt(r['warm_up_ms'])} | {fmt(r['first_ms'])} | {fmt(r['until_first_ms'])} | "
                       f"{fmt(r['second_ms'])} | {ratio} |")
        out.append("")
    st = {r["test"]: r for r in summary if r.get("scenario") == "store" and "test" in r}
    if st:
        engines = [e for e in STORE_ENGINES if any(e in r["ms"] or e in r["errors"] for r in st.values())]
        label = {"umbp": "UMBP local", "umbp-standalone": "UMBP standalone", "umbp-distributed": "UMBP distributed",
                 "mooncake": "Mooncake Store"}
        w, rs = st.get("whole"), st.get("restore")
        what = []
        if w:
            what.append(f"whole: {w.get('keys')} objects of {w.get('object_bytes')} B, one batch")
        if rs:
            what.append(f"restore: seed 000, {rs.get('pages')} pages, {rs.get('fragments')} fragments, "
                        f"{rs.get('bytes')} B, layer groups of 8")
        out.append(f"**store** ({'; '.join(what)}; median of rounds; ratio: Mooncake's time over ours, "
                   ">= 1.0x where we lead)")
        out.append("")
        umbps = [e for e in engines if e.startswith("umbp")]
        out.append("| call | " + " | ".join(label[e] for e in engines) + " | "
                   + " | ".join(f"Mooncake / {label[e]}" for e in umbps) + " |")
        out.append("| --- | " + " | ".join("---:" for _ in engines + umbps) + " |")
        for test, k, name in (("whole", "put_ms", "batch put (ms)"), ("whole", "get_ms", "batch get, whole objects (ms)"),
                              ("restore", "put_ms", "restore: put, ranged from the KV layout (ms)"),
                              ("restore", "ttfl_us", "restore: TTFL (us)"), ("restore", "load_ms", "restore: load (ms)")):
            r = st.get(test)
            if not r:
                continue
            cells = [fmt(r["ms"][e][k]) if e in r["ms"] else ("failed" if e in r["errors"] else "—") for e in engines]
            rts = [bold(r.get("ratios", {}).get(e, {}).get(k)) for e in umbps]
            out.append(f"| {name} | " + " | ".join(cells + rts) + " |")
        out.append("")
    kl = [r for r in summary if r.get("scenario") == "kill"]
    if kl:
        out.append("**a peer that dies** (target SIGKILLed the given time into a 1 GiB write batch of 1 MiB "
                   "requests; then the target restarted at the same address and a 64 MiB write to it, byte-verified; "
                   "kill to return: median over the rounds the kill came mid-batch)")
        out.append("")
        out.append("| engine | rounds | killed after (s) | outcome (rounds) | kill to return (ms) | deregister the source "
                   "after (ms): waited / the call | restart at the same address (s) | next transfer works | how | "
                   "next transfer (ms) | error |")
        out.append("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |")
        for r in kl:
            how = "; ".join(r.get("next_transfer") or []) or "—"
            out.append(f"| {r['engine']} | {r['runs']} | {fmt(r.get('kill_after_s'), 2)} | {', '.join(map(str, r['outcomes']))} | "
                       f"{fmt(r['ms_to_return'], 1)} | {fmt(r['deregister_ms'])} / {fmt(r.get('deregister_call_ms'))} | "
                       f"{fmt(r.get('restart_s'), 1)} | "
                       f"{r.get('next_ok', 0)} of {r['runs']} | {how} | {fmt(r.get('next_ms'), 1)} | "
                       f"{r['message'] or ''} |")
        out.append("")
    return "\n".join(out) + "\n"


ORDER = ["ours", "compat", "ours-rust", "ours-rust-shm", "mooncake", "mooncake-cpp-bench", "nixl", "nixl-prep"]


STORE_ENGINES = ["umbp", "umbp-standalone", "umbp-distributed", "mooncake"]


def engine_order(e):
    return ORDER.index(e) if e in ORDER else len(ORDER)


COLOURS = {"ours": "#1f77b4", "compat": "#9467bd", "ours-rust": "#6baed6", "ours-rust-shm": "#08306b", "mooncake": "#d62728",
           "mooncake-cpp-bench": "#ff9896", "nixl": "#2ca02c", "nixl-prep": "#98df8a"}


def svg_bars(title, rows, engines, unit="GB/s"):
    """Grouped bars on a log axis, hand-written SVG: one group per (shape, op), one bar per engine."""
    import math

    vals = [v for r in rows for v in r["gbps"].values() if v and v > 0]
    if not vals:
        return "<svg xmlns='http://www.w3.org/2000/svg' width='400' height='40'><text x='10' y='25'>no data</text></svg>"
    lo = 10 ** math.floor(math.log10(min(vals)))
    hi = 10 ** math.ceil(math.log10(max(vals)))
    if hi <= lo:
        hi = lo * 10
    gw = max(8 * len(engines) + 14, 60)
    left, top, h = 70, 40, 300
    width = left + gw * len(rows) + 180
    height = top + h + 90
    y = lambda v: top + h - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * h  # noqa: E731
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-family='sans-serif' "
           f"font-size='11'>", f"<rect width='{width}' height='{height}' fill='white'/>",
           f"<text x='{width / 2}' y='20' text-anchor='middle' font-size='14'>{title}</text>"]
    d = lo
    while d <= hi * 1.0001:
        yy = y(d)
        out.append(f"<line x1='{left}' y1='{yy:.1f}' x2='{left + gw * len(rows)}' y2='{yy:.1f}' stroke='#ddd'/>")
        out.append(f"<text x='{left - 4}' y='{yy + 4:.1f}' text-anchor='end'>{d:g}</text>")
        d *= 10
    out.append(f"<text x='14' y='{top + h / 2}' transform='rotate(-90 14 {top + h / 2})' text-anchor='middle'>{unit}</text>")
    bw = (gw - 12) / len(engines)
    for i, r in enumerate(rows):
        x0 = left + i * gw + 6
        for j, e in enumerate(engines):
            v = r["gbps"].get(e)
            if not v:
                continue
            yy = y(max(v, lo))
            out.append(f"<rect x='{x0 + j * bw:.1f}' y='{yy:.1f}' width='{bw - 1:.1f}' height='{top + h - yy:.1f}' "
                       f"fill='{COLOURS.get(e, '#999')}'><title>{e} {r['shape']} {r['op']}: {v:.4g} {unit}</title></rect>")
        label = f"{r['shape']} {r['op']}".strip()
        cx = left + i * gw + gw / 2
        out.append(f"<text x='{cx:.1f}' y='{top + h + 12}' text-anchor='end' transform='rotate(-45 {cx:.1f} "
                   f"{top + h + 12})'>{label}</text>")
    lx = left + gw * len(rows) + 15
    for j, e in enumerate(engines):
        out.append(f"<rect x='{lx}' y='{top + j * 16}' width='10' height='10' fill='{COLOURS.get(e, '#999')}'/>")
        out.append(f"<text x='{lx + 14}' y='{top + j * 16 + 9}'>{e}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "target/peers-bench"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=3, help="timed passes per row per round; first contact: fresh processes per engine and mode per round")
    p.add_argument("--scenarios", default="p2p,same-host,connector,register,first-contact,kill,store")
    p.add_argument("--shapes", default="4K:16M,64K:64M,1M:64M,4M:64M,kv:1728,kv:8448,kv:37440")
    p.add_argument("--ops", default="write,read")
    p.add_argument("--batch-bytes", default="8M")
    p.add_argument("--reg-scale", type=float, default=1.0, help="registration sizes x this")
    p.add_argument("--mc-duration", type=int, default=2, help="seconds per transfer_engine_bench run")
    p.add_argument("--store-keys", type=int, default=256, help="objects per batch in the store scenario")
    p.add_argument("--store-pages", type=int, default=32, help="pages of the store scenario's layer-wise restore")
    p.add_argument("--kill-bytes", default="1G", help="the batch the kill scenario interrupts")
    p.add_argument("--kill-after", type=float, default=0.2, help="seconds after the submit")
    p.add_argument("--kill-restart-limit", type=float, default=90.0,
                   help="seconds a restarted target may take to get the killed one's address back")
    p.add_argument("--no-rust", action="store_true", help="skip the te-bench rows")
    p.add_argument("--no-mooncake-bench", action="store_true")
    p.add_argument("--verify", action="store_true", help="accepted for clarity: every row is byte-verified")
    p.add_argument("--versions", default="{}")
    p.add_argument("--summarise-only", action="store_true")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    argv = sys.argv[1:]
    if "--versions" in argv:  # peers-bench.sh's own: shown as the versions, not the command
        i = argv.index("--versions")
        argv = argv[:i] + argv[i + 2:]
    command = " ".join(["scripts/peers-bench.sh", *argv])
    versions = json.loads(args.versions)
    if not args.summarise_only:
        open(os.path.join(args.out, "rows.jsonl"), "w").close()
        r = Runner(args.out, not args.quiet)
        shapes = args.shapes.split(",")
        ops = args.ops.split(",")
        batch = size(args.batch_bytes)
        scen = args.scenarios.split(",")
        rust = not args.no_rust and os.path.exists(TE_BENCH)
        if not args.no_rust and not rust:
            print(f"peers-bench: no {TE_BENCH}: the te-bench rows (ours from Rust, the shm transport) are left out "
                  "(cargo build --release -p te-bench)", file=sys.stderr)
        bb = ["--batch-bytes", args.batch_bytes]
        for rnd in range(args.rounds):
            print(f"== round {rnd + 1}/{args.rounds}, load {load()}", file=sys.stderr, flush=True)
            tcp = {"UCX_TLS": "tcp"}
            if "p2p" in scen:
                r.p2p_python("p2p", "ours", shapes, ops, args.repeat, rnd, None, bb)
                r.p2p_python("p2p", "mooncake", shapes, ops, args.repeat, rnd, None, bb)
                r.p2p_python("p2p", "nixl", shapes, ops, args.repeat, rnd, tcp, bb)
                if rust:
                    r.p2p_te_bench("p2p", "tcp", shapes, ops, args.repeat, rnd, batch)
                if not args.no_mooncake_bench:
                    r.p2p_mooncake_bench("p2p", shapes, ops, rnd, args.mc_duration, batch)
                r.p2p_python("p2p", "nixl-prep", shapes, ops, args.repeat, rnd, tcp, bb)
            if "connector" in scen:
                # vLLM's Mooncake connector loop: one batch_transfer_sync_write per request of seed
                # 000's KV fragments, through te.compat.mooncake and through the real wheel.
                kv = [s for s in shapes if s in KV] or ["kv:1728"]
                pr = ["--per-request", *bb]
                r.p2p_python("connector", "compat", kv, ["write"], args.repeat, rnd, None, pr)
                r.p2p_python("connector", "mooncake", kv, ["write"], args.repeat, rnd, None, pr)
            if "same-host" in scen:
                # Ours from Python on the shm transport the wheel carries (tcp installed too: the
                # row records the route the segment actually took).
                r.p2p_python("same-host", "ours", shapes, ops, args.repeat, rnd, None,
                             [*bb, "--ours-transports", "shm,tcp", "--path", "same-host"])
                if rust:
                    r.p2p_te_bench("same-host", "shm", shapes, ops, args.repeat, rnd, batch)
                r.p2p_python("same-host", "nixl", shapes, ops, args.repeat, rnd, {"UCX_TLS": None}, bb)
                r.p2p_python("same-host", "nixl-prep", shapes, ops, args.repeat, rnd, {"UCX_TLS": None}, bb)
            if "register" in scen:
                for shape in ("seed001", "views"):
                    for e in ("ours", "mooncake", "nixl"):
                        r.register("register", e, shape, rnd, args.reg_scale)
                r.register("register", "ours", "views-pool", rnd, args.reg_scale)
            if "first-contact" in scen:
                # One sample is one fresh process; --repeat of them per engine and mode each round,
                # interleaved, as a single first contact varies by milliseconds from run to run.
                for _ in range(args.repeat):
                    for mode in ("cold", "warm"):
                        for e in ("ours", "mooncake", "nixl"):
                            r.first_contact("first-contact", e, mode, rnd, tcp if e == "nixl" else None)
            if "store" in scen:
                for e in STORE_ENGINES:
                    r.store("store", e, rnd, args.store_keys, args.store_pages, args.repeat)
            if "kill" in scen:
                # Like for like: ours over tcp beside Mooncake's tcp and NIXL's UCX_TLS=tcp; ours over
                # its same-host route (shm) beside NIXL's UCX default (shared memory / cma), both
                # killed at the same moment, early enough to be mid-batch: on an idle machine ours
                # moves the 1 GiB there in about 0.05 s and NIXL in about 0.17 s.
                same_host = ("--kill-after", str(min(args.kill_after, 0.02)))
                for e, env, extra in (("ours", None, ()), ("mooncake", None, ()), ("nixl", tcp, ()),
                                      ("ours", None, ("--ours-transports", "shm,tcp", *same_host)),
                                      ("nixl", {"UCX_TLS": None}, same_host)):
                    r.kill("kill", e, rnd, args.kill_bytes, args.kill_after, args.kill_restart_limit, env, extra)
    summarise(args.out, versions, command)
    rows = [json.loads(line) for line in open(os.path.join(args.out, "rows.jsonl"))]
    failed = [x for x in rows if "error" in x and x.get("engine", "").startswith(("ours", "compat", "umbp"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
