"""The two stages on the engine: talker (the LM, the Mimi encoder, personas) and code2wav (the
Mimi decoder). They may import engine, lm, mimi and core, never serving."""
