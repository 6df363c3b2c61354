#!/usr/bin/env python3
"""A conversation that grows past a KV window, through `moestream serve`.

Starts `moestream serve -m MODEL --ctx CTX --kv-window W --kv-sinks S`, then plays a chat as
clients do: every turn appends a user message (the next chunk of a text file) and re-sends the
whole conversation to /v1/chat/completions (greedy, a short reply), the reply is appended, and so
on until the prompt reaches --target tokens. After each turn it notes the prompt's tokens, how
many of them the prefix cache reused, the turn's time and the server's resident memory (VmRSS).

It fails (exit 1, one line) unless every turn answers with some text and the resident memory
grows, from the first turn on, by less than --rss-share of what a full KV cache of the final
length would take (kv_bytes_per_token per token, from `moestream run --stats` with the same
flags): with a window the KV cache is S + W rows per layer whatever the length, so a window that
does not hold shows up as growth at the full cache's rate. (The server's other memory still
grows a little with the conversation: docs/PERFORMANCE.md has the numbers.)

    scripts/long_conversation.py --bin build/moestream -m models/pystd-moe-20m-q4 \\
        --ctx 32768 --kv-window 512 --kv-sinks 4 --target 32768 [--json out.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def kv_stats(args):
    """kv_bytes_per_token and the ring's positions, as `run --stats` reports them."""
    cmd = [args.bin, "run", "-m", args.model, "-p", "def", "-n", "1", "--temp", "0", "--stats",
           "--kv-window", str(args.kv_window), "--kv-sinks", str(args.kv_sinks)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    for line in reversed(r.stderr.splitlines()):
        if line.startswith("{"):
            j = json.loads(line)
            return j["kv_bytes_per_token"], j.get("kv_ring_positions", 0)
    sys.exit(f"long_conversation: `{' '.join(cmd)}` printed no --stats line: {r.stderr.strip()[-300:]}")


def post(port, body, timeout):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="build/moestream")
    p.add_argument("-m", "--model", default="models/pystd-moe-20m-q4")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--kv-window", type=int, default=512)
    p.add_argument("--kv-sinks", type=int, default=4)
    p.add_argument("--target", type=int, default=32768, help="stop once the prompt has this many tokens")
    p.add_argument("--text", default=None, help="user turns are its chunks (default: the model's heldout.txt)")
    p.add_argument("--turn-chars", type=int, default=3000, help="characters of text per user turn")
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--rss-share", type=float, default=0.5,
                   help="most the resident memory may grow, as a share of a full KV cache of the final length")
    p.add_argument("--json", default=None, help="write the turns and the verdict here")
    args = p.parse_args()
    text_path = args.text or os.path.join(args.model, "heldout.txt")
    text = open(text_path, encoding="utf-8").read()
    kv_per_token, ring = kv_stats(args)

    server = subprocess.Popen([args.bin, "serve", "-m", args.model, "--port", "0", "--ctx", str(args.ctx),
                               "--kv-window", str(args.kv_window), "--kv-sinks", str(args.kv_sinks)],
                              stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stderr:
            m = re.search(r"on http://[^:]+:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            sys.exit(f"long_conversation: serve exited with {server.wait()} before listening")
        turns, messages, at, start = [], [], 0, time.time()
        while True:
            chunk = text[at:at + args.turn_chars]
            at = (at + args.turn_chars) % max(1, len(text) - args.turn_chars)
            messages.append({"role": "user", "content": chunk})
            t0 = time.time()
            r = post(port, {"model": "m", "messages": messages, "max_tokens": args.reply_tokens, "temperature": 0},
                     timeout=600)
            reply = r["choices"][0]["message"]["content"] or ""
            usage = r.get("usage", {})
            turn = {"turn": len(turns) + 1, "prompt_tokens": usage.get("prompt_tokens", 0),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "reply_tokens": usage.get("completion_tokens", 0), "seconds": round(time.time() - t0, 3),
                    "rss_mb": round(rss_bytes(server.pid) / 2**20, 1), "reply": reply[:40]}
            turns.append(turn)
            print(json.dumps(turn), flush=True)
            if not reply.strip():
                sys.exit(f"long_conversation: turn {turn['turn']} ({turn['prompt_tokens']} prompt tokens) got an empty reply")
            messages.append({"role": "assistant", "content": reply})
            if turn["prompt_tokens"] >= args.target:
                break
        base = turns[0]["rss_mb"]
        growth = max(t["rss_mb"] for t in turns) - base
        full_mb = kv_per_token * turns[-1]["prompt_tokens"] / 2**20
        verdict = {"prompt_tokens": turns[-1]["prompt_tokens"], "turns": len(turns),
                   "seconds": round(time.time() - start, 1), "kv_bytes_per_token": kv_per_token,
                   "kv_ring_positions": ring, "kv_ring_mb_per_sequence": round(kv_per_token * ring / 2**20, 2),
                   "full_cache_mb_at_end": round(full_mb, 1), "rss_mb_first_turn": base,
                   "rss_mb_max": max(t["rss_mb"] for t in turns), "rss_growth_mb": round(growth, 1),
                   "ok": growth < args.rss_share * full_mb}
        print(json.dumps(verdict), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "turns": turns, "verdict": verdict}, f, indent=1)
        if not verdict["ok"]:
            sys.exit(f"long_conversation: resident memory grew {growth:.1f} MB over the conversation, more than "
                     f"--rss-share {args.rss_share} of a full KV cache's {full_mb:.1f} MB: is the window held?")
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
