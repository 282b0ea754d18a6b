"""The playground page."""

from fastapi import APIRouter

router = APIRouter()
