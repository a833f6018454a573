"""A tensor-parallel worker process (ranks 1..N-1): `python -m kvgate.engine.distributed.worker FD`.

FD is its end of the control channel (workers.py). It joins the process group, builds its rank's ModelRunner (its
shard of the weights, its heads' KV cache), answers the KV-cache sizing and allocation, then runs each step whose
header arrives: the step's inputs come by broadcast from rank 0, it runs the forward pass on its shard and takes
part in the logits' gather (the scheduler and the sampler are rank 0's alone). It ends when the channel ends or
says stop, and on any error, which it reports over the channel first when it can.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import sys
import traceback

log = logging.getLogger("kvgate.engine.distributed.worker")


def serve(conn: multiprocessing.connection.Connection) -> None:
    import torch

    from kvgate.engine.distributed.group import connect_store, create_group
    from kvgate.engine.model_runner import ModelRunner

    start = conn.recv()
    torch.set_num_threads(start.cpu_threads)
    device = torch.device(start.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store(start.store_port, start.world_size)
    group = create_group(store, start.rank, start.world_size, device)
    runner = ModelRunner(start.config, start.hf_config, device, start.dtype, start.max_model_len, tp=group)
    conn.send(("ok", None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            kind = message[0]
            if kind == "step":
                runner.run_worker_step(message[1])
            elif kind == "num_blocks":
                conn.send(("ok", runner.determine_num_blocks()))
            elif kind == "allocate":
                runner.allocate_kv_cache(message[1], capture_graphs=message[2])
                conn.send(("ok", None))
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown command {kind!r}")
    finally:
        runner.close()


def main() -> None:
    # A Ctrl-C reaches the whole process group: ending is rank 0's to decide (this worker ends with its channel).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s tp-worker: %(message)s")
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    try:
        serve(conn)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then this process ends
        text = f"{type(exc).__name__}: {exc}"
        log.error("%s\n%s", text, traceback.format_exc())
        try:
            conn.send(("error", text[:1000]))
        except OSError:
            pass
        sys.exit(1)


if __name__ == "__main__":
    main()
