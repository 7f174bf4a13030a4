import torch

# The first arithmetic on the meta device (the stand-in for an accelerator in these tests) loads
# torch's meta kernels, which takes seconds: done once here, at collection, so that no test pays it
# (mutation runs fork every test run from a process that has collected the tests).
torch.empty(1, device="meta") + 1
