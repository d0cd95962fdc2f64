"""`bnaudit fed`: how a federated server combined its clients' BatchNorm statistics, from the
checkpoints alone (torch-free): classify.py (the classes and their tolerances), federation.py
(files -> FedReport), report.py (the record)."""
