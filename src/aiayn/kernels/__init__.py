"""Hand-written C kernels for the CPU (Eq. 1 forward and backward, beam-step attention, the
label-smoothed loss, log-softmax with top-k, int8 row passes), compiled with the system's C compiler on
first use and loaded by ``aiayn.kernels.loader``; every one has a PyTorch path it is tested against.
One Triton kernel for CUDA, the fused loss's rows (``triton_loss``, imported only where it runs)."""
