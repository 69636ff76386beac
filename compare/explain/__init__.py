"""Sentences, made last from typed records: findings.py says what a structure Finding
(compare.judge.structure, conventions) found, ladder.py what a rung's Evidence record
(compare.evidence) decided. Nothing decides on what is written here."""
