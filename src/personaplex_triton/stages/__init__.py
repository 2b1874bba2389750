"""The two stages as Python objects: the talker (LM + Mimi encoder, personas) and code2wav (Mimi
decoder). They import engine, lm, mimi and core; nothing of serving."""
