"""The score_model grader's judge: operator-configured endpoints and their client."""

from grading.judge.client import JudgeReply, chat_all, request_body
from grading.judge.settings import JudgeEndpoint, JudgeSettings, build_judge_settings

__all__ = [
    "JudgeEndpoint",
    "JudgeReply",
    "JudgeSettings",
    "build_judge_settings",
    "chat_all",
    "request_body",
]
