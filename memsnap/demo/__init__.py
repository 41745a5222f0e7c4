"""``memsnap demo``: a node killed mid-training on a simulated Ray cluster, the job resuming
from peers' RAM, and a loss curve bitwise identical to a run that never failed.

    model.py      the small transformer and its synthetic data
    train.py      one rank's training loop (the same code with and without Ray Train)
    reference.py  the run that never fails (plain gloo processes)
    run.py        what both drivers share: options, a run, its failures, the victim
    driver.py     the cluster, the Ray Train job (--restart), the failure and the report
    inplace_driver.py  the default: the job recovering in place (InplaceJob)
    plot.py       the loss curves as a PNG
"""
