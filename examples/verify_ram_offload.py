"""Prove where training memory lives (VRAM, pinned host, pageable host), with a PASS/FAIL verdict.

    python examples/verify_ram_offload.py [--hidden 2048] [--layers 8] [--steps 3]

Trains the same model with stock torch AdamW and with TrainStream and tabulates the bytes of each
kind by where they live. Exits 0 on PASS, 1 on FAIL, 2 without a CUDA GPU. The code lives in
trainstream.verify, so `python -m trainstream verify` runs the same check.
"""

from trainstream.verify import main

if __name__ == "__main__":
    raise SystemExit(main())
