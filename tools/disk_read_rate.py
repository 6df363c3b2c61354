#!/usr/bin/env python3
"""The sustained O_DIRECT read rate of a pack's expert files, by reads in flight.

Reads random whole experts (or pieces of them) of PACK with THREADS reads in flight for SECONDS,
and prints the rate overall and for each second. bench's raw rate is one such sample (1 GB, 16
whole experts in flight); this shows how the rate moves with the reads in flight and over time
(docs/PERFORMANCE.md, session 44). Standard library only; Linux.

  tools/disk_read_rate.py PACK THREADS SECONDS [PIECE_BYTES]
"""
import json
import mmap
import os
import random
import sys
import threading
import time

ALIGN = 4096


def experts_of(manifest):
    """(file index, offset, size) of every expert in the manifest's layers."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if {"file", "offset", "size"} <= x.keys():
                found.append((x["file"], x["offset"], x["size"]))
            else:
                for v in x.values():
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(manifest["layers"])
    return found


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    pack, threads, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    piece = int(sys.argv[4]) if len(sys.argv) == 5 else 0
    with open(os.path.join(pack, "moestream-pack.json")) as f:
        manifest = json.load(f)
    fds = [os.open(os.path.join(pack, p), os.O_RDONLY | os.O_DIRECT) for p in manifest["expert_files"]]
    experts = experts_of(manifest)
    random.seed(threads * 1000 + piece)
    random.shuffle(experts)
    largest = max(size for _, _, size in experts)
    lock = threading.Lock()
    next_index = [0]
    done = []  # (seconds since start, bytes)
    start = time.time()

    def reader():
        buf = mmap.mmap(-1, (largest + ALIGN - 1) // ALIGN * ALIGN)  # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                if time.time() - start > seconds:
                    return
                file, offset, size = experts[next_index[0] % len(experts)]
                next_index[0] += 1
            size = (size + ALIGN - 1) // ALIGN * ALIGN
            step = piece or size
            for at in range(0, size, step):
                n = min(step, size - at)
                os.preadv(fds[file], [memoryview(buf)[:n]], offset + at)
            with lock:
                done.append((time.time() - start, size))

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    per_second = {}
    for t, size in done:
        per_second[int(t)] = per_second.get(int(t), 0) + size
    total = sum(size for _, size in done)
    print(f"{threads} in flight, {'pieces of %d bytes' % piece if piece else 'whole experts'}: "
          f"{total / 1e9:.2f} GB in {seconds:.0f} s = {total / seconds / 1e9:.2f} GB/s; each second: "
          + " ".join(f"{per_second.get(i, 0) / 1e9:.2f}" for i in range(int(seconds))))


if __name__ == "__main__":
    main()
