import torch
import moshray

def batches(shard, num_shards, seed):  # your data: any iterator of batches per shard
    g = torch.Generator().manual_seed(seed * 1000 + shard)
    for x in torch.randn(50, 32, 16, generator=g):  # 50 batches of 32 samples
        yield x, (x.sum(dim=1) > 0).long()

def loop(session):  # runs inside every replica, on its GPU if it has one
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = session.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for x, y in session.batches():  # this replica's shards, until the job stops
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # clip, unscale or inspect the gradients here if you like
        opt.step(); opt.zero_grad()  # moshray decides when the replicas average a step
        session.report({"loss": loss})  # console, summary, TensorBoard

if __name__ == "__main__":
    result = moshray.fit(loop, moshray.data.from_fn(batches), max_nodes=2, max_seconds=60)
    print(result.summary["steps"], "global steps, final loss", result.summary["final_loss"])
