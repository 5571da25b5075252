import torch
import moshray

def batches(shard, num_shards, seed):  # your data: any iterator of batches per shard
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    for _ in range(50):
        x = torch.randn(32, 16, generator=g)
        yield x, (x.sum(dim=1) > 0).long()

def loop(session):  # runs inside every replica, on its GPU if it has one
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in session.batches():  # this replica's shards, until the job stops
        opt.step(torch.nn.functional.cross_entropy(model(x), y))  # moshray decides global steps

if __name__ == "__main__":
    result = moshray.fit(loop, moshray.data.from_fn(batches), max_nodes=2, max_seconds=60)
    print(result.summary["steps"], "global steps, final loss", result.summary["final_loss"])
