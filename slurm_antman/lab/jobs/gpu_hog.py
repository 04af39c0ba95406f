"""A guaranteed job that takes most of a small emulated GPU (the agent reports RSS as GPU memory on
CPU): ~1.2 GB touched, then a slow training loop. Used by the coordinator tests and
`antman bench coordinator` to create a need that shrinking cannot meet."""
import time, torch
torch.set_num_threads(1)
big = torch.ones(300 * 1024 * 1024 // 4 * 4)  # ~1.2 GB, touched
m = torch.nn.Linear(8, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(100000):
    opt.zero_grad(); m(torch.randn(4, 8)).sum().backward(); opt.step(); time.sleep(0.1)
