"""The review's routes in one router: JSON API (/review/api), web pages (/review) and /export."""

from __future__ import annotations

from fastapi import APIRouter

from app.review.api import export_router
from app.review.api import router as api_router
from app.review.ui import router as ui_router

router = APIRouter()
router.include_router(api_router)
router.include_router(export_router)
router.include_router(ui_router)
