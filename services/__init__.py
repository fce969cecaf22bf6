"""The four network services (perception, llm, tts, codec) and what they share (services.common).

Importing them sets nothing in the process: the entry points (`run_service`, the orchestrator's command line)
call `services.common.loading.process_settings()` before MLX runs.
"""
