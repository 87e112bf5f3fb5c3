"""The precision study: a sweep of attention precision configurations for one model,
measured against an fp32/HIGHEST reference (see `attnprec.study.sweep`)."""
