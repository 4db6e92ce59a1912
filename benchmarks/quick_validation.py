"""Quick validation runs of one method config: the searches behind the BLR / IVON defaults.

Run (1 torch thread; prints one line per seed and the mean ± std):

    python benchmarks/quick_validation.py split_digits blr '{"clip_radius": 0.3}' 0 1 2 3 4 --scenario class
    python benchmarks/quick_validation.py split_mnist blr '{"clip_radius": 0.03}' 100 --data-dir $CONTINUAL_BLR_DATA

Each task's training data is split 90 / 10 with a ``torch.Generator`` seeded 1000 + seed; the run trains on the
90 % and reports accuracy on the 10 % (never the test set; ``--test`` evaluates on the test set instead).
Per seed it prints the just-trained and final accuracies, the median logit margin on task 1 and the largest
weight-matrix norm (the BLR's stability diagnostics). Budgets as the benchmark configs: split digits MLP 100-100,
10 epochs, batch 32; split MNIST MLP 256-256, 15 epochs, batch 128 (``--tasks`` / ``--epochs`` shorten a run).
"""
import argparse, json, time, sys, dataclasses, statistics
import torch
torch.set_num_threads(1)
from continual_blr.data import make_stream
from continual_blr.models import build_model
from continual_blr.methods import build_method, TrainConfig
from continual_blr.loop import run_stream

ap = argparse.ArgumentParser()
ap.add_argument("stream"); ap.add_argument("method"); ap.add_argument("params")
ap.add_argument("seeds", nargs="+", type=int)
ap.add_argument("--epochs", type=int, default=None); ap.add_argument("--tasks", type=int, default=None)
ap.add_argument("--scenario", default="task"); ap.add_argument("--test", action="store_true")
ap.add_argument("--lr", type=float, default=None)
ap.add_argument("--data-dir", default=None, help="data root (else $CONTINUAL_BLR_DATA)")
a = ap.parse_args()
cfg = {"split_digits": dict(hidden=(100, 100), epochs=10, batch=32, lr=1e-3, kw={}),
       "split_mnist": dict(hidden=(256, 256), epochs=15, batch=128, lr=1e-4, kw={}),
       "permuted_mnist": dict(hidden=(100, 100), epochs=10, batch=128, lr=1e-3, kw={})}[a.stream]
accs = []
for seed in a.seeds:
    stream = make_stream(a.stream, scenario=a.scenario if a.stream != "permuted_mnist" else "domain", seed=0, data_dir=a.data_dir) if a.stream!="split_digits" else make_stream(a.stream, scenario=a.scenario)
    if a.tasks: stream.tasks = stream.tasks[: a.tasks]
    if not a.test:  # carve 10 % validation from train
        g = torch.Generator().manual_seed(1000 + seed)
        new = []
        for t in stream.tasks:
            perm = torch.randperm(t.n_train, generator=g); nv = t.n_train // 10
            v, tr = perm[:nv], perm[nv:]
            new.append(dataclasses.replace(t, x_train=t.x_train[tr], y_train=t.y_train[tr], x_test=t.x_train[v], y_test=t.y_train[v]))
        stream.tasks = new
    model = build_model("mlp", stream.input_shape, stream.n_outputs, stream.n_heads, hidden=cfg["hidden"], generator=torch.Generator().manual_seed(seed))
    method = build_method(a.method, json.loads(a.params), seed=seed)
    t0 = time.process_time()
    try:
        r = run_stream(model, stream, method, TrainConfig(epochs=a.epochs or cfg["epochs"], batch_size=cfg["batch"], lr=a.lr or cfg["lr"]), seed=seed, progress=False)
    except Exception as e:
        print(f"seed {seed}: FAILED {type(e).__name__}: {str(e)[:150]}"); accs.append(float('nan')); continue
    cpu = time.process_time() - t0
    # diagnostics: max weight norm, median logit margin on task 0 test
    with torch.no_grad():
        t0_ = stream.tasks[0]; f = model(t0_.x_test[:500], head=t0_.head)
        top2 = f.topk(2, -1).values; margin = (top2[:, 0] - top2[:, 1]).median().item()
        wn = max(p.norm().item() for n, p in model.named_parameters() if "weight" in n)
    diag = [round(r.acc_matrix[i][i]*100, 1) for i in range(len(stream.tasks))]
    print(f"seed {seed}: avg {r.avg_acc*100:.2f} just-trained {diag} final {[round(x*100,1) for x in r.acc_matrix[-1]]} margin {margin:.1f} maxWnorm {wn:.1f} cpu {cpu:.1f}s", flush=True)
    accs.append(r.avg_acc * 100)
ok = [x for x in accs if x == x]
print(f"== {a.method} {a.params}: {statistics.mean(ok) if ok else float('nan'):.2f} ± {statistics.stdev(ok) if len(ok)>1 else 0:.2f} (n={len(ok)}/{len(accs)})")
