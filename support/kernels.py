"""Stand-ins for Triton kernels in tests that need no triton."""


class BrokenKernel:
    """A kernel whose launch raises, as one without a compiler for the GPU would; `launches` lists
    the grid of every attempted launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append(grid)
            raise RuntimeError("no compiler for this GPU")
        return launch
