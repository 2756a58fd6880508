"""Save the example models the way users keep theirs, to try ``ckpt-planner report`` on them.

    python examples/save_models.py OUT_DIR

writes OUT_DIR/gpt2 (a HuggingFace ``save_pretrained`` directory), OUT_DIR/residual_mlp.pt2
(``torch.export.save``, with its example inputs) and OUT_DIR/residual_mlp.pkl (a whole pickled
module; report it with ``--trust-pickle --input-shape 2048x256:float32`` and this folder on
PYTHONPATH, since unpickling imports the class).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import gpt2, residual_mlp  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model, _ = gpt2()
    model.save_pretrained(out / "gpt2")
    mlp, inputs = residual_mlp()
    torch.export.save(torch.export.export(mlp, inputs, strict=False), out / "residual_mlp.pt2")
    torch.save(mlp, out / "residual_mlp.pkl")
    print(f"saved gpt2/, residual_mlp.pt2 and residual_mlp.pkl under {out}")


if __name__ == "__main__":
    main()
