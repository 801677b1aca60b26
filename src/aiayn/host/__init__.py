"""The process settings of the aiayn command on a CPU, applied before the first tensor: the memory
allocator, transparent huge pages, denormals flushed to zero, oneDNN's primitive cache, and the
parent-death signal of worker processes (``process.configure_process`` applies them all)."""
