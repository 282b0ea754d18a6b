"""OpenAI-compatible routes (/v1/...)."""

from fastapi import APIRouter

router = APIRouter()
