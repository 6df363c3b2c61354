#!/usr/bin/env python3
"""Prints the lines of a `moestream bench --json` result that scripts/gpu-test and
scripts/gpu-bench-big record: the limits measured in the same run, pp, tg, and tg's fractions of
the HBM, PCIe and disk bounds."""
import json
import sys

j = json.load(open(sys.argv[1]))
g = j.get("gpu", {})
print(f"   backend {j['backend']}; device copy {g.get('d2d_gb_per_s', 0):.0f} GB/s, pinned H2D {g.get('h2d_pinned_gb_per_s', 0):.1f} GB/s "
      f"({g.get('h2d_slot_gb_per_s', 0):.1f} per expert-sized copy), disk raw read {j['raw_read_gb_per_s']:.2f} GB/s")
if g:
    print(f"   GEMV one token: bf16 4096x2048 {g['gemv_bf16_gb_per_s']:.0f} GB/s, bf16 151936x2048 {g['gemv_bf16_head_gb_per_s']:.0f} GB/s, "
          f"q4 expert {g['gemv_q4_expert_gb_per_s']:.0f} GB/s; launch {g['launch_us']:.1f} us host, {g['launch_drain_us']:.1f} us with drain, "
          f"launch+sync {g['round_trip_us']:.1f} us")
if "pp" in j:
    print(f"   pp{j['pp']['tokens']}: {j['pp']['tok_per_s']:.1f} tok/s")
if "tg" in j:
    t = j["tg"]
    tg = t.get("gpu", {})
    print(f"   tg{t['tokens']}: {t['tok_per_s']:.2f} tok/s; {j['active_bytes_per_token']/1e6:.0f} MB of weights/token -> "
          f"{100*tg.get('of_hbm_bound', 0):.0f}% of HBM bound ({tg.get('hbm_bound_tok_per_s', 0):.0f} tok/s)")
    print(f"         VRAM hit rate {100*tg.get('vram_hit_rate', 0):.1f}%, PCIe {tg.get('pcie_bytes_per_token', 0)/1e6:.1f} MB/token -> "
          f"{100*tg.get('of_pcie_bound', 0):.0f}% of PCIe bound ({tg.get('pcie_bound_tok_per_s', 0):.1f} tok/s); "
          f"disk {t['bytes_read_per_token']/1e6:.1f} MB/token -> {100*tg.get('of_disk_bound', 0):.0f}% of disk bound "
          f"({tg.get('disk_bound_tok_per_s', 0):.1f} tok/s)")
