"""Device kernels (Triton) and their torch references. Import submodules explicitly; this file stays import-free."""
