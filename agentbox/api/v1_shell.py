"""Routes: v1_shell (being written)."""

from fastapi import APIRouter

router = APIRouter()
