"""Start a simulated multi-node Ray cluster on 127.0.0.1 and keep it up until Ctrl-C.

    python cluster/launch_local.py --nodes 4
    # in another shell:  RAY_ADDRESS=<printed address> python my_training.py

Every node gets a ``memsnap_node_<i>`` resource (to pin work to it) and the fast node-failure
detection settings memsnap recommends (see memsnap/localcluster.py).
"""
from __future__ import annotations

import argparse
import signal
import threading

from memsnap.localcluster import LocalCluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--cpus-per-node", type=float, default=1)
    ap.add_argument("--object-store-mb", type=int, default=128)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with LocalCluster(args.nodes, cpus_per_node=args.cpus_per_node,
                      object_store_mb=args.object_store_mb, connect=False) as cluster:
        print(f"Ray cluster of {args.nodes} nodes on 127.0.0.1; RAY_ADDRESS={cluster.address}", flush=True)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    print("cluster stopped", flush=True)


if __name__ == "__main__":
    main()
