"""Task evaluations (HumanEval, retrieval, next-line, recall): one home, one results writer, one statistics module."""
