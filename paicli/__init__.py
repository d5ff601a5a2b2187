"""paicli: a PAI-style job submitter for distributed deep learning."""

__version__ = "0.1.0"
