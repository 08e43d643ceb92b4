"""MosaicML Streaming's StreamingDataset under ShmLoader / loader.DataLoader:
a state taken mid-epoch in one process, resumed in a fresh one
(tests/torch_layer/test_streaming_resume.py runs it with an interpreter
that imports `streaming`; NOTE [ Datasets that resume themselves ]).

  streaming_resume_run.py cut DIR     write the data, run each scenario to its
                                      cut, save the state, then go on
                                      uninterrupted: DIR/<name>.json
  streaming_resume_run.py resume DIR  a fresh process: each scenario resumed
                                      from its state, DIR/<name>.resumed.json
"""
import json
import os
import shutil
import sys

import numpy as np
import torch

import loader
from streaming import MDSWriter, StreamingDataset
from streaming.base.util import clean_stale_shared_memory

N, BS, K = 160, 16, 3
# name: (loader class, num_workers, persistent_workers, shuffle, the epoch cut)
SCENARIOS = {
    "dataloader-2-workers-epoch-2": ("DataLoader", 2, False, True, 2),
    "dataloader-persistent-epoch-1": ("DataLoader", 2, True, True, 1),
    "shmloader-unshuffled-epoch-1": ("ShmLoader", 2, False, False, 1),
    "shmloader-main-epoch-0": ("ShmLoader", 0, False, True, 0),
}


def write(data: str) -> None:
    with MDSWriter(out=data, columns={"idx": "int", "x": "ndarray:float32:4"},
                   size_limit=1 << 10) as w:
        for i in range(N):
            w.write({"idx": i, "x": np.full(4, i, np.float32)})


def make(data: str, name: str):
    kind, workers, persistent, shuffle, _ = SCENARIOS[name]
    local = os.path.join(os.path.dirname(data), name)  # its own copy: its own shared memory
    if not os.path.exists(local):
        shutil.copytree(data, local)
    ds = StreamingDataset(local=local, remote=None, shuffle=shuffle, shuffle_seed=7,
                          batch_size=BS)
    if kind == "DataLoader":
        return loader.DataLoader(ds, batch_size=BS, num_workers=workers,
                                 persistent_workers=persistent)
    return loader.ShmLoader(ds, batch_size=BS, num_workers=workers,
                            persistent_workers=persistent)


def ids(batch) -> list:
    return [int(i) for i in batch["idx"]]


def cut(out: str, data: str, name: str) -> None:
    dl, epoch = make(data, name), SCENARIOS[name][4]
    for _ in range(epoch):
        for _ in dl:
            pass
    it = iter(dl)
    before = [i for _ in range(K) for i in ids(next(it))]
    torch.save(dl.state_dict(), os.path.join(out, f"{name}.pt"))
    rest = [i for b in it for i in ids(b)]
    following = [i for b in dl for i in ids(b)]
    dl.close()
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"before": before, "rest": rest, "following": following}, f)


def resume(out: str, data: str, name: str) -> None:
    dl = make(data, name)
    dl.load_state_dict(torch.load(os.path.join(out, f"{name}.pt"), weights_only=False))
    rest = [i for b in dl for i in ids(b)]
    following = [i for b in dl for i in ids(b)]
    dl.close()
    with open(os.path.join(out, f"{name}.resumed.json"), "w") as f:
        json.dump({"rest": rest, "following": following}, f)


def main(step: str, out: str) -> None:
    import warnings

    warnings.simplefilter("error", loader.InexactResumeWarning)
    clean_stale_shared_memory()
    data = os.path.join(out, "mds")
    if step == "cut":
        write(data)
    for name in SCENARIOS:
        (cut if step == "cut" else resume)(out, data, name)
    print("DONE")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
