"""Worker-stage patches, applied when a UBTree worker initialises (see ``MANIFEST``)."""
