"""A function index of ELF binaries on disk (``index_files``: its format; ``index``: building it,
incrementally and resumably) and exact cosine search over it (``query``)."""
