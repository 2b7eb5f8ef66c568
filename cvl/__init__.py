"""cvl: continual vision-language pretraining toolkit (streams, methods, evaluation, analysis)."""

__version__ = "0.1.0"
