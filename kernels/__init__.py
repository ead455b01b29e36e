"""Device kernels, each beside a plain-torch reference implementation."""
