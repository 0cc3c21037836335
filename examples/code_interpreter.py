"""A code-interpreter tool on dsec: the cells an agent would send, run in one context that keeps its
variables (a Jupyter kernel in the built-in dsec/code:1 image), with the answers a model would be shown.

    python examples/code_interpreter.py --plot /tmp/plot.png      # DSEC_URL / DSEC_TOKEN name the daemon
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import dsec

CELLS = [
    "import numpy as np, pandas as pd\nrng = np.random.default_rng(0)\n"
    "df = pd.DataFrame({'x': np.arange(50), 'y': 3 * np.arange(50) + rng.normal(0, 5, 50)})",
    "slope, intercept = np.polyfit(df.x, df.y, 1)\nprint(f'fit: y = {slope:.2f} x + {intercept:.2f}')\nround(slope)",
    "import matplotlib.pyplot as plt\nplt.scatter(df.x, df.y, s=8)\n"
    "plt.plot(df.x, slope * df.x + intercept)\nplt.show()",
    "df.describe().loc[['mean', 'std']]",
    "df.z  # a mistake: the tool answers with the error, and the context lives on",
    "len(df)",
]


def main(plot: Path | None) -> None:
    with dsec.Sandbox.create("dsec/code:1") as sb:  # the first use of dsec/code:1 builds it (about 2 minutes)
        for cell in CELLS:
            r = sb.run_code(cell, timeout=120)
            print(f">>> {cell.splitlines()[-1]}")
            if r.stdout:
                print(r.stdout, end="")
            if r.error is not None:
                print(f"error: {r.error.name}: {r.error.value}")
            elif r.text is not None:
                print(r.text)
            for image in r.images:
                print(f"[a {len(base64.b64decode(image))}-byte PNG]")
                if plot is not None:
                    plot.write_bytes(base64.b64decode(image))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, help="write the figure here")
    main(parser.parse_args().plot)
